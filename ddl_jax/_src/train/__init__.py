"""Training around a strategy: fit, its logs, checkpoints, multi-process launch, mixed precision."""
