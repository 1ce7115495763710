"""Test models and the tensor-parallel layers they are built from."""
