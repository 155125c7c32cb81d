"""The control plane: the coordinator's prompt tickets and versions, generator leases, staleness, evaluations."""
