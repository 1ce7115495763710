"""The implementation, in layers that import only those below them: train; strategies
(models and data beside them); reduce; measure; core; xla_cpu. See docs/design.md."""
