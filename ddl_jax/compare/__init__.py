"""The `ddl-jax compare` application: every strategy on one workload, same data and seed.

``compare(workload, strategies, **settings)`` runs it on a ``Workload`` of your own;
``ddl-jax compare --workload module:function`` does from the command line.
"""

from ddl_jax.compare.run import compare, run_compare
from ddl_jax.compare.specs import CompareError
from ddl_jax.compare.workloads import Workload, make_workload

__all__ = ["CompareError", "Workload", "compare", "make_workload", "run_compare"]
