"""The strategies, one module or subpackage per family."""
