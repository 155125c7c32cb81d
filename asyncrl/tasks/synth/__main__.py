"""``python -m asyncrl.tasks.synth``: see :mod:`asyncrl.tasks.synth`."""

from asyncrl.tasks.synth.cli import main

main()
