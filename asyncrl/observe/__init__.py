"""What a run records for people to look at: metrics.jsonl and TensorBoard, Prometheus endpoints, the trace, logs."""
