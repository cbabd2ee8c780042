"""Training: DeepSpeed engine, schedule, checkpoints, the loop."""
