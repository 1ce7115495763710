"""``ddl-jax compare``'s workloads: a model, its data stream and its evaluation.

The four bundled workloads are instances of :class:`Workload`; a user's own is any
function returning one, named on the command line as ``--workload module:function`` (or
``workload = "module:function"`` in a TOML config), or passed to ``compare`` in Python.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ddl_jax import data, models
from ddl_jax import flax as flax_bridge
from ddl_jax.compare.specs import CompareError


class Workload(NamedTuple):
    """One model and data set, the same for every strategy of a comparison.

    Attributes:
      name: the workload's name (``"digits-mlp"``, ...).
      title: a few words for tables and figure titles.
      loss_fn: ``(params, batch) -> loss``, or a ``ddl.ModelLoss``.
      params: the initial variables (seeded).
      batches: ``start -> iterator`` of global batches in the seeded order, a new iterator
        at each call (every strategy trains on the same batches).
      evaluate: jitted ``variables -> scalar``: the metric on held-out data.
      metric: the metric's name with its unit, for axes and tables.
      higher_is_better: whether the target is reached from below (accuracy) or above.
      target: the default target of the metric.
      steps: the default number of training steps.
      batch_size: examples per global batch.
    """

    name: str
    title: str
    loss_fn: Any
    params: Any
    batches: Callable[[int], Iterator[Any]]
    evaluate: Callable[[Any], Any]
    metric: str
    higher_is_better: bool
    target: float
    steps: int
    batch_size: int


def _classification(
    model: nnx.Module, flatten: bool, seed: int, devices: int, non_iid: float | None, **meta: Any
):
    train, test = data.digits(flatten=flatten)

    def loss(model, batch):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss_fn, params = flax_bridge.loss_from_module(model, loss, seed=seed)
    model.eval()  # evaluation with running batch statistics (ResNet)
    apply, _ = flax_bridge.split(model)

    @jax.jit
    def accuracy(variables):
        return jnp.mean(jnp.argmax(apply(variables, test["image"]), -1) == test["label"])

    batch_size = 16 * devices

    def batches(start: int) -> Any:
        if non_iid is None:  # many workers: more rows than examples, drawn with replacement
            replace = batch_size > len(train["label"])
            return data.batches(train, batch_size, seed=seed, start=start, replace=replace)
        options = {"workers": devices, "alpha": non_iid, "seed": seed, "start": start}
        return data.non_iid_batches(train, batch_size, **options)

    return Workload(
        loss_fn=loss_fn,
        params=params,
        batches=batches,
        evaluate=accuracy,
        metric="test accuracy",
        higher_is_better=True,
        batch_size=batch_size,
        **meta,
    )


def _text_gpt(seed: int, devices: int, compute_dtype: Any = None) -> Workload:
    context = 64
    train, validation = data.text()
    model = models.GPT(
        context=context,
        features=64,
        heads=4,
        layers=2,
        dropout=0.1,
        dtype=compute_dtype,
        rngs=nnx.Rngs(params=seed, dropout=seed + 1),
    )

    def loss(model, batch):
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss_fn, params = flax_bridge.loss_from_module(model, loss, seed=seed)
    model.eval()
    apply, _ = flax_bridge.split(model)
    held_out = next(data.lm_batches(validation, 256, context, seed=0))["tokens"]

    @jax.jit
    def bits_per_byte(variables):
        logits = apply(variables, held_out[:, :-1])
        nats = optax.softmax_cross_entropy_with_integer_labels(logits, held_out[:, 1:]).mean()
        return models.bits_per_byte(nats)

    batch_size = 8 * devices
    return Workload(
        name="text-gpt",
        title="byte-level GPT (2 layers, 64 wide) on Python's sources",
        loss_fn=loss_fn,
        params=params,
        batches=lambda start: data.lm_batches(train, batch_size, context, seed=seed, start=start),
        evaluate=bits_per_byte,
        metric="validation bits per byte",
        higher_is_better=False,
        target=3.0,
        steps=300,
        batch_size=batch_size,
    )


#: The digits workloads: name -> (model from rngs, flat images, title, target, default steps).
_DIGITS: dict[str, tuple[Callable[[nnx.Rngs], nnx.Module], bool, str, float, int]] = {
    "digits-mlp": (
        lambda rngs: models.MLP(64, [128, 128], 10, rngs=rngs),
        True,
        "digits MLP 64-128-128-10",
        0.95,
        300,
    ),
    "digits-cnn": (lambda rngs: models.CNN(rngs=rngs), False, "digits CNN", 0.9, 200),
    "digits-resnet": (
        lambda rngs: models.ResNet(rngs=rngs),
        False,
        "digits ResNet (batch norm)",
        0.9,
        200,
    ),
}


def make_workload(
    name: str,
    *,
    seed: int,
    devices: int,
    compute_dtype: Any = None,
    non_iid: float | None = None,
) -> Workload:
    """Builds the workload ``name`` (one of ``specs.WORKLOADS``).

    Args:
      name: ``"digits-mlp"``, ``"digits-cnn"``, ``"digits-resnet"`` or ``"text-gpt"``.
      seed: seed of the initialisation, the data order and dropout.
      devices: workers; each sees 16 examples (8 windows for text-gpt) per step.
      compute_dtype: text-gpt only: the dtype its layers compute in (see ``ddl.models.GPT``).
      non_iid: digits only: the Dirichlet alpha of label-skewed worker shares (``None``:
        i.i.d. batches).
    """
    rngs = nnx.Rngs(seed)
    if name in _DIGITS:
        make, flatten, title, target, steps = _DIGITS[name]
        meta = {"name": name, "title": title, "target": target, "steps": steps}
        return _classification(make(rngs), flatten, seed, devices, non_iid, **meta)
    if name == "text-gpt":
        if non_iid is not None:
            raise ValueError("non_iid splits labels: a digits workload, not text-gpt.")
        return _text_gpt(seed, devices, compute_dtype)
    raise ValueError(f"unknown workload {name!r}.")


def load(spec: str, *, seed: int, devices: int, non_iid: float | None = None) -> Workload:
    """The workload of a bundled name or of ``"module:function"`` (the module found on
    ``sys.path`` or in the working directory): the function is called with those of
    ``seed``, ``devices`` and ``non_iid`` it takes as keywords (a function taking
    ``**options`` gets ``seed``, ``devices``, and ``non_iid`` where one is given).

    Raises:
      CompareError: the module or function cannot be found, takes other arguments, does
        not take a ``non_iid`` (or a ``seed`` other than 0) that is given, or returns
        something other than a working ``Workload``.
    """
    if ":" not in spec:
        return make_workload(spec, seed=seed, devices=devices, non_iid=non_iid)
    module_name, _, name = spec.partition(":")
    if os.getcwd() not in sys.path:  # as `python -m` would: the user's own modules
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise CompareError(f"workload {spec!r}: cannot load it ({e}).") from None
    offered = {"seed": seed, "devices": devices, "non_iid": non_iid}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise CompareError(f"workload {spec!r} is not a function.") from None
    needed = [
        p.name
        for p in params.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    unknown = [n for n in needed if n not in offered]
    if unknown:
        raise CompareError(
            f"workload {spec!r} needs {', '.join(unknown)}; it may take any of "
            "seed, devices, non_iid as keywords, and nothing else."
        )
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unreachable = {
        "non_iid": ("its batches", "ddl.data.non_iid_batches", non_iid is not None),
        "seed": ("its initialisation and data order", "", seed != 0),
    }
    for name, (what, how, given) in unreachable.items():
        if given and not takes_all and name not in params:
            raise CompareError(
                f"workload {spec!r} does not take {name}, so --{name.replace('_', '-')} "
                f"cannot reach {what}; give it a {name} keyword{f' ({how})' if how else ''} "
                f"or leave --{name.replace('_', '-')} out."
            )
    try:
        # **options gets the settings given: non_iid only with --non-iid
        given = {k: v for k, v in offered.items() if k in params or (takes_all and v is not None)}
        workload = fn(**given)
    except Exception as e:
        raise CompareError(f"workload {spec!r} failed: {type(e).__name__}: {e}") from None
    return check(workload, spec)


def check(workload: Any, where: str) -> Workload:
    """``workload`` if it is a working ``Workload``: batches come, the evaluation of the
    initial variables is one finite number. Raises ``CompareError`` naming what to change."""
    if not isinstance(workload, Workload):
        raise CompareError(
            f"workload {where!r} returned {type(workload).__name__}, not a "
            "ddl_jax.compare.Workload."
        )
    for field in ("loss_fn", "batches", "evaluate"):
        value = getattr(workload, field)
        if not callable(value) and not (field == "loss_fn" and hasattr(value, "fn")):
            raise CompareError(f"workload {where!r}: {field} must be callable, got {value!r}.")
    try:
        first = next(iter(workload.batches(0)))
    except Exception as e:
        raise CompareError(
            f"workload {where!r}: batches(0) must yield global batches; it raised "
            f"{type(e).__name__}: {e}"
        ) from None
    again = next(iter(workload.batches(0)), None)
    if again is None or not _same_batch(first, again):
        raise CompareError(
            f"workload {where!r}: batches(0) called twice gave different first batches; every "
            "strategy must train on the same batches in the same order, so batches(start) must "
            "start a new, seeded iterator at each call (not hand back a shared one)."
        )
    rows = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(first)}
    if rows != {workload.batch_size}:
        raise CompareError(
            f"workload {where!r}: batch_size={workload.batch_size!r}, but the first batch of "
            f"batches(0) has {sorted(rows, key=str)} rows (its leaves' leading sizes): give "
            "the rows of every global batch."
        )
    try:
        value = workload.evaluate(workload.params)
    except Exception as e:
        raise CompareError(
            f"workload {where!r}: evaluate(params) raised {type(e).__name__}: {e}"
        ) from None
    if not _finite_number(value):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise CompareError(
            f"workload {where!r}: evaluate(params) must return one finite number (the "
            f"metric), got {type(value).__name__} {shown}."
        )
    return workload


def _same_batch(a: Any, b: Any) -> bool:
    """Whether two batches hold the same arrays (structure, shapes and values)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if not np.array_equal(x, y, equal_nan=x.dtype.kind in "fc" and y.dtype.kind in "fc"):
            return False
    return True


def _finite_number(value: Any) -> bool:
    """Whether ``value`` is one finite real number (a Python number, a 0-d array)."""
    if isinstance(value, bool) or np.ndim(value) != 0:
        return False
    array = np.asarray(value)
    real = np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
    return bool(real and np.isfinite(array))
