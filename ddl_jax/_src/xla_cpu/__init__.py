"""Tunings for XLA:CPU and gloo. They track XLA:CPU's current behaviour and may go when
it changes."""
