"""The fine-tuning loop, CLI, data, checkpoints and benchmarks. Arrive with the Training issue."""
