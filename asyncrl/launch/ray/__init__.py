"""``asyncrl run --ray``: the same learner and generator entrypoints placed as Ray actors, which Ray restarts."""
