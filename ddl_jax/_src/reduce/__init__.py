"""Gradient reducers: all-reduce algorithms, Adasum and the compressors, as optax transforms."""
