"""asyncrl: asynchronous actor-learner RL for post-training LLMs.

The package stands on floors, from the bottom: ``wire`` (messages, sockets, addresses), ``tasks`` (prompts,
rewards, datasets), ``config``, ``observe`` (metrics, Prometheus, trace, logs), ``control`` (coordinator and
staleness), ``weights`` (every weight transport) and ``run_folder``; the roles ``learners`` and ``generators``
and the ``buffers`` stand on those, and ``launch`` (the CLI, launchers, Ray, sweeps) on everything.
Nothing imports a floor above its own (``tests/test_layering.py``).
"""
