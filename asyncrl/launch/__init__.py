"""Everything that starts processes: the asyncrl CLI, the local launcher, Ray, sweeps and model import.

Nothing below this package imports it."""
