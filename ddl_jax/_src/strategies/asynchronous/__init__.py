"""Asynchronous SGD: the event clock, its protocols and staleness-aware optimizers."""
