"""The learner process: DeepSpeed ZeRO-3 training on rollouts from the buffer, publishing versioned weights."""
