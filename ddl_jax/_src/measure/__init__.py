"""Measurements of a strategy: bytes sent, a network's time model, replica consistency."""
