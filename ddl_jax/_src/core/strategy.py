"""The Strategy abstraction, the axis names, and the argument checks every builder shares."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

Params = Any
State = Any
Batch = Any
Metrics = dict[str, jax.Array]
LossFn = Callable[..., Any]

#: Mesh axis names the strategies understand, in the order they are laid out: ``island``
#: (the slow network between groups of devices: an outer method over an inner strategy),
#: then the inner strategy's own.
ISLAND, DATA, STAGE, MODEL = "island", "data", "stage", "model"
AXIS_NAMES = (ISLAND, DATA, STAGE, MODEL)
#: The ``jax.vmap`` axis of a device's workers when it runs several (``workers=``): a
#: strategy's collectives then name ``(data, VIRTUAL)``, all the workers.
VIRTUAL = "virtual"


def vary_over(x: Any, axis: str | tuple[str, ...]) -> Any:
    """``lax.pcast(x, axis, to="varying")`` over the mesh axes of ``axis`` (``VIRTUAL``,
    a ``vmap`` axis, has no varying type to cast to)."""
    axes = tuple(a for a in ((axis,) if isinstance(axis, str) else axis) if a != VIRTUAL)
    return jax.lax.pcast(x, axes, to="varying") if axes else x


class Strategy(NamedTuple):
    """A distributed training strategy: three pure functions over pytrees.

    Attributes:
      init: ``params -> state``; places a full training state on the mesh.
      step: ``(state, global_batch) -> (state, metrics)``; one training step, pure and
        jittable (jit it with ``donate_argnums=0``). ``metrics`` is a flat dict of scalars
        holding at least ``loss``.
      params: ``state -> params``; the model to evaluate.
    """

    init: Callable[[Params], State]
    step: Callable[[State, Batch], tuple[State, Metrics]]
    params: Callable[[State], Params]


def check_mesh_axis(mesh: Mesh, axis: str, *, arg: str = "axis") -> int:
    """Returns the size of ``mesh``'s axis ``axis``; raises a clear error if it has none."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (see ddl.make_mesh), got {type(mesh).__name__}."
        )
    if axis not in mesh.axis_names:
        raise ValueError(
            f"{arg}={axis!r} is not an axis of the mesh; valid axis names: {list(mesh.axis_names)}."
        )
    return mesh.shape[axis]


def check_params(params: Params) -> None:
    """Raises ``TypeError`` unless ``params`` is a non-empty pytree of floating arrays."""
    if isinstance(params, nnx.Module):
        raise TypeError(
            f"params is a Flax NNX module ({type(params).__name__}); pass its parameters: "
            "loss_fn, params = ddl.flax.loss_from_module(module, loss)."
        )
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise TypeError(
            "params must be a non-empty pytree of floating-point arrays, got no leaves."
        )
    for path, leaf in leaves:
        where = f"params{jax.tree_util.keystr(path)}"
        if isinstance(leaf, np.generic):
            raise TypeError(
                f"params must be a pytree of arrays; {where} is a NumPy scalar ({leaf.dtype}): "
                "wrap it as an array, np.asarray(x) or jnp.asarray(x)."
            )
        if not isinstance(leaf, jax.Array | np.ndarray) or not jnp.issubdtype(
            leaf.dtype, jnp.floating
        ):
            kind = getattr(leaf, "dtype", type(leaf).__name__)
            advice = (
                " (split a complex parameter into its real and imaginary parts: the "
                "compressing reducers and byte counts take real numbers)"
                if jnp.issubdtype(getattr(leaf, "dtype", np.int8), jnp.complexfloating)
                else ""
            )
            raise TypeError(
                f"params must be a pytree of real floating-point arrays (jax.Array or "
                f"np.ndarray); {where} is {kind}{advice}."
            )


def _described(out: Any) -> str:
    """``loss_fn``'s abstract output in words: an array as ``float32[]``, a tree as its
    leaves' (``(float32[], {acc: float32[]})``)."""
    if isinstance(out, jax.ShapeDtypeStruct):
        return f"one array, {out.dtype}{list(out.shape)}"
    return str(jax.tree.map(lambda s: f"{s.dtype}{list(s.shape)}", out)).replace("'", "")


#: Metric names the strategies and ``ddl.fit`` write themselves: an aux value of one of
#: these names would replace theirs (a ``loss`` that hides a non-finite one from ``fit``),
#: or be replaced. ``synchronised_<field>`` (DES-LOC's averages) is reserved too.
RESERVED_METRICS = frozenset({
    "loss", "step", "skipped", "synchronised", "arrived", "sync_group_size",
    "consensus_distance", "compression_ratio", "fragment", "messages_dropped",
    "workers_present", "staleness_mean", "staleness_max", "pushes", "fetches",
    "pushes_lost", "updates_applied", "wall_clock", "clock_gap_max", "replica_lag",
    "workers_away", "variance_updated",
})  # fmt: skip


def check_loss_output(out: Any, *, has_aux: bool) -> None:
    """Checks the abstract output of ``loss_fn`` (from ``jax.eval_shape``)."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise TypeError(
                "loss_fn was declared has_aux=True, so it must return (loss, aux_dict); "
                f"it returned {_described(out)}."
            )
        loss, aux = out
        taken = sorted(k for k in aux if k in RESERVED_METRICS or k.startswith("synchronised_"))
        if taken or any(k.startswith("eval") for k in aux):
            names = taken or sorted(k for k in aux if k.startswith("eval"))
            raise ValueError(
                f"loss_fn's aux names {names} are metrics the strategies or ddl.fit write "
                "themselves (loss, step, eval..., synchronised, staleness_mean, ...); rename "
                "them, e.g. aux_" + names[0] + "."
            )
        for name, value in aux.items():
            if (
                not isinstance(value, jax.ShapeDtypeStruct)
                or value.shape != ()
                or not jnp.issubdtype(value.dtype, jnp.floating)
            ):
                raise ValueError(
                    f"loss_fn's aux[{name!r}] must be a floating-point scalar metric (workers "
                    f"average it), got {value}."
                )
    else:
        loss = out
    if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != ():
        shape = getattr(loss, "shape", type(loss).__name__)
        hint = " (or pass has_aux=True if it returns (loss, aux))" if isinstance(out, tuple) else ""
        raise ValueError(
            f"loss_fn must return a scalar loss{hint}; it returned shape {shape}. "
            "Reduce over the batch, e.g. with .mean()."
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(f"loss_fn must return a floating-point loss, got dtype {loss.dtype}.")


def check_batch(batch: Batch, divisor: int, *, why: str) -> int:
    """Returns the global batch size; raises unless every leaf shares it and it divides.

    Args:
      batch: pytree whose leaves have a leading batch axis.
      divisor: the batch size must be a multiple of this.
      why: what ``divisor`` is made of, for the error message.
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("batch must be a non-empty pytree of arrays with a leading batch axis.")
    sizes = {}
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} is a scalar; every batch leaf needs a "
                "leading batch axis."
            )
        sizes[jax.tree_util.keystr(path)] = shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch leaves disagree on the batch size: {sizes}.")
    size = next(iter(sizes.values()))
    if size % divisor:
        raise ValueError(
            f"global batch size {size} is not divisible by {divisor} ({why}); use a multiple "
            f"of {divisor}, e.g. {max(divisor, size // divisor * divisor)}."
        )
    return size


def check_bool(name: str, value: Any) -> bool:
    """Returns ``value``; raises ``ValueError`` unless it is a Python ``bool``."""
    if isinstance(value, bool):
        return value
    raise ValueError(f"{name} must be a bool, got {value!r}.")


def check_int(
    name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """Returns ``value`` as an ``int``; raises ``ValueError`` unless it is an integer
    (Python or NumPy, not ``bool``) within ``[minimum, maximum]``."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)
    if ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return int(value)
    bounds = " and ".join(
        f"{op} {b}" for op, b in ((">=", minimum), ("<=", maximum)) if b is not None
    )
    raise ValueError(f"{name} must be an int{' ' + bounds if bounds else ''}, got {value!r}.")


def check_real(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive: bool = False,
) -> float:
    """Returns ``value`` as a ``float``; raises ``ValueError`` unless it is a finite real
    number (Python, NumPy, or a JAX scalar array; not ``bool``) within the bounds (open ones
    if ``exclusive``)."""
    if (
        isinstance(value, jax.Array)
        and not isinstance(value, jax.core.Tracer)
        and value.shape == ()
        and jnp.issubdtype(value.dtype, jnp.number)
        and not jnp.issubdtype(value.dtype, jnp.complexfloating)
    ):
        value = value.item()  # jnp.float32(0.1): a concrete number, as np.float32 is
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)
    if ok and math.isfinite(value):
        low = minimum is None or (value > minimum if exclusive else value >= minimum)
        high = maximum is None or (value < maximum if exclusive else value <= maximum)
        if low and high:
            return float(value)
    ops = (">", "<") if exclusive else (">=", "<=")
    bounds = " and ".join(
        f"{op} {b}" for op, b in zip(ops, (minimum, maximum), strict=True) if b is not None
    )
    raise ValueError(
        f"{name} must be a finite real number{' ' + bounds if bounds else ''}, got {value!r}."
    )


def check_transform(name: str, value: Any, example: str) -> None:
    """Raises ``TypeError`` unless ``value`` is an optax ``GradientTransformation``."""
    if not all(callable(getattr(value, f, None)) for f in ("init", "update")):
        raise TypeError(
            f"{name} must be an optax.GradientTransformation (e.g. {example}), "
            f"got {type(value).__name__}."
        )
