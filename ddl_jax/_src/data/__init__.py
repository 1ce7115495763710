"""Bundled datasets, batching, and non-i.i.d. shards."""
