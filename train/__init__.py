"""Fine-tuning: configs, data, the train step and loop, CLI, checkpoints, benchmarks."""
