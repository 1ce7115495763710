"""Weight-gradient products laid out for XLA:CPU's matrix-multiply library.

Autodiff turns a dense layer's ``x @ w`` into a weight gradient ``dot_general(dy, x)``
contracting the leading dimensions of both (the batch; batch and sequence in a sequence
model), then transposes it; XLA:CPU lowers that to a matrix product whose left operand
contracts dimension 0. XLA:CPU hands matrix products to YNNPACK only when the left
operand contracts its last dimension, so the weight gradient stays on the generic Eigen
product. In a process that runs on one core that takes about twice as long
(``docs/figures.md``); PyTorch's BLAS call takes a transposed operand natively. Where the
process has several cores, Eigen's product runs threaded and the two layouts take about
the same time, so :func:`applies` leaves them alone.

:func:`transposed_weight_gradients` re-evaluates a function's jaxpr with each such product
computed from an explicit transpose of one operand (both viewed as matrices over the
contracted rows); an optimization barrier keeps XLA from folding the transpose back into
the product. Same mathematics, same result up to float rounding. The builder kit applies
it (the strategies' gradients and the pipeline's backward) where :func:`applies`: only
with the XLA:CPU tunings on (``tunings.py``), so by default results do not depend on the
process's CPU affinity.
"""

import math
import os
from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.extend import core as jcore
from jax.extend import source_info_util
from jax.extend.core.primitives import dot_general_p, jit_p
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddl_jax._src.xla_cpu import tunings


def one_core() -> bool:
    """Whether this process may run on one CPU core only (XLA:CPU then runs single-threaded)."""
    if hasattr(os, "sched_getaffinity"):  # the cores taskset / cgroups leave this process
        return len(os.sched_getaffinity(0)) == 1
    return os.cpu_count() == 1


def applies(mesh: Mesh) -> bool:
    """Whether steps on ``mesh`` compute their weight gradients from explicit transposes:
    with the XLA:CPU tunings on (``tunings.py``), on CPU devices, in a process that runs
    on one core (as a CPU cluster with one process per core does)."""
    return tunings.active_on(mesh.devices.flat[0].platform) and one_core()


def _contracts_leading(eqn: Any) -> bool:
    """A product without batch dimensions whose left operand contracts its leading
    dimensions: autodiff's weight gradient (both operands contracting the same leading
    dimensions, e.g. batch and sequence) or a 2-D left operand contracting dimension 0."""
    if eqn.primitive is not dot_general_p:
        return False
    (lhs_c, rhs_c), (lhs_b, _) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval for v in eqn.invars)
    leading = tuple(range(len(lhs_c)))
    if lhs_b or tuple(lhs_c) != leading or lhs.ndim == len(lhs_c):
        return False
    if tuple(rhs_c) == leading and rhs.ndim > len(rhs_c):
        # Operands of more than two dimensions are reshaped: only where nothing is sharded.
        sharding = eqn.params.get("out_sharding")
        unsharded = sharding is None or all(s is None for s in sharding.spec)
        return unsharded or (lhs.ndim, rhs.ndim) == (2, 2)
    return (lhs.ndim, rhs.ndim) == (2, 2)


def _matrix(sharding: NamedSharding | None, transposed: bool) -> NamedSharding | None:
    """The sharding of ``_product``'s 2-D product (``dy^T x``, or ``x^T dy`` if
    ``transposed``), from the weight gradient's (``_contracts_leading``: more than two
    dimensions only where it partitions nothing)."""
    if sharding is None:
        return None
    spec = (*sharding.spec, None, None)[:2]
    return NamedSharding(sharding.mesh, P(*(reversed(spec) if transposed else spec)))


def _product(lhs: Any, rhs: Any, params: dict[str, Any]) -> Any:
    """``dot_general(lhs, rhs)`` (lhs contracting its leading dimensions), from a
    transposed operand.

    When ``rhs`` contracts the same leading dimensions (autodiff's weight gradient,
    ``dy^T x`` over the batch), both are viewed as matrices of those rows and the product
    is computed as ``(x^T dy)^T``: the transpose autodiff applies next then cancels. Where
    ``dy`` is so much narrower than ``x`` that transposing it and the result moves fewer
    entries than transposing ``x``, it is computed as ``dy^T x`` from a transposed ``dy``.
    """
    (lhs_c, rhs_c), _ = params["dimension_numbers"]
    barrier = lax.optimization_barrier
    if tuple(rhs_c) == tuple(lhs_c):
        rows = math.prod(lhs.shape[: len(lhs_c)])
        dy, x = lhs.reshape(rows, -1), rhs.reshape(rows, -1)
        shape = lhs.shape[len(lhs_c) :] + rhs.shape[len(rhs_c) :]
        sharding = params.get("out_sharding")
        contract = {**params, "dimension_numbers": (((1,), (0,)), ((), ()))}
        if rows * dy.shape[1] + dy.shape[1] * x.shape[1] < rows * x.shape[1]:
            # dy much narrower than x (a classifier's last layer): transpose dy, then the
            # small result (where autodiff transposes it next), rather than all of x.
            direct = {**contract, "out_sharding": _matrix(sharding, transposed=False)}
            return barrier(dot_general_p.bind(barrier(dy.T), x, **direct)).reshape(shape)
        swapped = {**contract, "out_sharding": _matrix(sharding, transposed=True)}
        out = barrier(dot_general_p.bind(barrier(x.T), dy, **swapped)).T
        return out.reshape(shape)
    leading = {**params, "dimension_numbers": (((1,), tuple(rhs_c)), ((), ()))}
    return barrier(dot_general_p.bind(barrier(lhs.T), rhs, **leading))


def _evaluate(jaxpr: Any, consts: list[Any], *args: Any) -> list[Any]:
    """``jax.core.eval_jaxpr`` that rewrites the leading-dimension products, inlining jits
    (other higher-order primitives run unchanged)."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with (
            source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
            eqn.ctx.manager,
        ):
            if _contracts_leading(eqn):
                outs = [_product(*invals, eqn.params)]
            elif eqn.primitive is jit_p:
                inner = eqn.params["jaxpr"]
                outs = _evaluate(inner.jaxpr, inner.consts, *invals)
            else:
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def transposed_weight_gradients(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every weight-gradient product (both operands contracting their leading
    dimensions) and every 2-D left operand contracting dimension 0 computed from an
    explicit transpose (see the module docstring). Traces ``fn`` once per call, under the
    caller's trace (call it inside ``jit`` / ``shard_map``)."""

    def rewritten(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _evaluate(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return rewritten
