"""``asyncrl sweep``: a grid of config overrides over seeds, run one at a time, and its report."""
