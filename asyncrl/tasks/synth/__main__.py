"""``python -m asyncrl.tasks.synth``: see :mod:`asyncrl.tasks.synth`."""

from asyncrl.tasks.synth.cli import main

if __name__ == "__main__":
    main()
