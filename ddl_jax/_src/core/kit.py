"""The builder kit: the one set of parts every strategy builder is assembled from.

A builder calls :func:`prepare` (argument checks, the mesh, the default reducer, the
model contract), states its state's ``PartitionSpec``s once, and gets from the kit:

* ``kit.init(make_state, specs)``: a pure ``make_state(params, model)`` placed by
  ``jax.jit(..., out_shardings=specs)`` (as big_vision does): no state is ever built on
  one device and moved;
* ``kit.step(worker_step, specs)``: ``worker_step(state, local_batch)`` under
  ``jax.shard_map`` with the same specs, after checking and sharding the global batch;
* ``kit.value_and_grad``: one worker's loss and gradient, over micro-batches, with model
  state and a dropout key (see ``model_loss.py``);
* ``kit.replicated(fn)``: ``fn`` jitted once, its output replicated on the user's mesh, for
  ``Strategy.params``.

**Islands.** A builder that accepts them (``prepare(..., islands=True)``: data parallelism,
FSDP, tensor parallelism) on a mesh with an ``island`` axis of size I builds I independent
copies of itself, one per island: every state leaf gets a leading axis of size I split over
``island``, the batch is split over ``(island, data)``, and the worker step sees one
island's state as before (its collectives stay on the island's own axes). Work outside the
``shard_map`` runs per island through ``kit.per_island``; ``Strategy.params`` is the mean
over islands. The islands never talk: an outer method (``ddl.local_sgd(inner=...)``) does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddl_jax._src.core import model_loss as ml
from ddl_jax._src.core import strategy as st
from ddl_jax._src.core.reducer import ScatterReducer, axes_communicated, checks_vma
from ddl_jax._src.xla_cpu import products as cpu_products

Specs = Any  # a PartitionSpec prefix of a state, or ``abstract state -> that prefix``
WorkerStep = Callable[[st.State, st.Batch], tuple[st.State, st.Metrics]]


def explicit_mesh(mesh: Mesh, axes: tuple[str, ...] = ()) -> Mesh:
    """``mesh`` with every axis Explicit, and a size-1 axis for each of ``axes`` it lacks.

    ``jax.make_mesh`` (and ``ddl.make_mesh``) already make Explicit axes; a
    ``jax.sharding.Mesh`` built by hand has Auto ones, which ``jax.sharding.reshard`` refuses.
    """
    devices, names = mesh.devices, tuple(mesh.axis_names)
    for axis in axes:
        if axis not in names:
            devices, names = devices[..., None], (*names, axis)
    if names == mesh.axis_names and all(t == AxisType.Explicit for t in mesh.axis_types):
        return mesh
    return Mesh(devices, names, axis_types=(AxisType.Explicit,) * len(names))


def vary(tree: Any, axes: tuple[str, ...]) -> Any:
    """Inside ``shard_map``: ``tree`` cast to varying over ``axes`` (where it is not yet)."""

    def one(leaf: jax.Array) -> jax.Array:
        varying = jax.typeof(leaf).manual_axis_type.varying
        missing = tuple(a for a in axes if a not in varying)
        return lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(one, tree)


def unstack(tree: Any) -> Any:
    """Inside ``shard_map``: this worker's entry of leaves stacked over the worker axis."""
    return jax.tree.map(lambda x: x[0], tree)


def restack(tree: Any) -> Any:
    """Inside ``shard_map``: the inverse of ``unstack``, for a ``P(axis)`` out_spec."""
    return jax.tree.map(lambda x: x[None], tree)


def one_worker(stacked: Any) -> Any:
    """Abstract shapes of one worker's entry of a worker-stacked pytree."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)


def replica_mean(stacked: Any) -> Any:
    """The average of worker-stacked replicas (summed in at least float32); integer
    leaves (counters) by their maximum, as ``model_loss.mean_over`` takes them."""

    def one(x: jax.Array) -> jax.Array:
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return x.max(axis=0)
        return x.mean(axis=0, dtype=jnp.promote_types(x.dtype, jnp.float32)).astype(x.dtype)

    return jax.tree.map(one, stacked)


def abstract(tree: Any) -> Any:
    """``tree`` as ``jax.ShapeDtypeStruct``s, dtypes as JAX would make its arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


class Kit(NamedTuple):
    """What :func:`prepare` checked and derived; the parts a builder assembles.

    Attributes:
      mesh: the mesh, every axis Explicit.
      axis: the worker (data) axis; ``n`` its size.
      reducer: the gradient reducer (``ddl.allreduce_mean(axis)`` by default), or ``None``
        for a builder that takes none.
      loss_fn: the user's loss, plain or a ``ModelLoss``.
      has_aux: whether the loss returns ``(loss, aux)``.
      accumulate: micro-batches per worker per gradient.
      islands: the size of the mesh's ``island`` axis (state stacked per island, see the
        module's docstring), or 0 when it has none.
      per_device: workers per device (``prepare(..., workers=W)``: W / the axis size);
        ``n`` counts them all, and a state stacked per worker holds ``per_device`` rows
        on each device, worker ``d * per_device + j`` at device d's row j.
      given_mesh: the mesh as the user gave it (its axis types too, without the axes
        ``prepare`` added), where ``Strategy.params`` returns; ``None``: ``mesh``.
    """

    mesh: Mesh
    axis: str
    n: int
    reducer: optax.GradientTransformation | None
    loss_fn: Callable[..., Any]
    has_aux: bool
    accumulate: int
    islands: int = 0
    per_device: int = 1
    given_mesh: Mesh | None = None

    @property
    def workers_axis(self) -> str | tuple[str, ...]:
        """What the strategy's collectives name to reach every worker: ``axis``, or with
        several workers a device ``(axis, VIRTUAL)`` (the step's ``vmap`` over them)."""
        return self.axis if self.per_device == 1 else (self.axis, st.VIRTUAL)

    @property
    def transposes_weight_gradients(self) -> bool:
        """Whether gradients are computed with ``cpu_products.transposed_weight_gradients``
        (the XLA:CPU tunings on, CPU devices, a process on one core:
        ``cpu_products.applies``)."""
        return cpu_products.applies(self.mesh)

    def shardings(self, specs: Any) -> Any:
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=is_spec)

    def stack(self, tree: Any) -> Any:
        """Inside ``make_state``: one copy of ``tree`` per worker (a leading axis of size n)."""
        return _copies(tree, self.n)

    def init(
        self, make_state: Callable[[st.Params, ml.ModelVars], st.State], specs: Specs
    ) -> Callable[[Any], st.State]:
        """``Strategy.init``: checks the variables, then builds and places the state at once.

        Args:
          make_state: ``(params, model) -> state``, pure; ``model`` is the fresh
            ``ModelVars`` (its ``state`` unstacked: stack it where workers hold their own).
          specs: the state's ``PartitionSpec`` prefix, or a function of the abstract state
            returning it.
        """

        def build(params, model_state):
            # Copies, so that no output aliases the caller's buffers (steps donate the state).
            params, model_state = jax.tree.map(jnp.copy, (params, model_state))
            return make_state(params, ml.init_vars(self.loss_fn, model_state))

        def build_islands(params, model_state):
            return _copies(build(params, model_state), self.islands)

        def init(variables: Any) -> st.State:
            params, model_state = ml.split_variables(self.loss_fn, variables)
            st.check_params(params)
            _check_model_state(model_state)
            params, model_state = _onto(self.mesh, (params, model_state))
            out = specs(jax.eval_shape(build, params, model_state)) if callable(specs) else specs
            make = build_islands if self.islands else build  # defined once: compiled once
            out = island_specs(out) if self.islands else out
            return jax.jit(make, out_shardings=self.shardings(out))(params, model_state)

        return init

    def step(
        self,
        worker_step: WorkerStep,
        specs: Specs,
        *,
        divisor: int | None = None,
        why: str | None = None,
        out_specs: Specs | None = None,
        vmap_workers: bool = True,
    ) -> Callable[[st.State, st.Batch], tuple[Any, st.Metrics]]:
        """``Strategy.step``: checks the global batch, shards it over the worker axis and
        runs ``worker_step(state, local_batch) -> (state, metrics)`` under ``shard_map``
        (state by ``specs``, metrics replicated).

        Args:
          divisor: what the global batch must divide by (default ``n * accumulate``);
            ``why`` says what it is made of.
          out_specs: for a worker step that returns something other than a new state
            (``ddl.fsdp``'s gradient shards), its ``PartitionSpec``s, or a function of the
            abstract state returning them; the state's specs by default.
          vmap_workers: with several workers a device (``per_device`` k > 1), run
            ``worker_step`` once per worker through ``jax.vmap`` over the axis
            ``VIRTUAL`` (each leaf stacked over ``axis`` seen as one worker's ``[1, ...]``
            entry, each worker its rows of the batch; collectives name
            ``workers_axis``); ``False``: the worker step takes the device's k rows itself.
        """
        islands = self.islands
        divisor = self.n * self.accumulate if divisor is None else divisor
        why = why or f"{self.n} workers on axis {self.axis!r} x accumulate={self.accumulate}"
        if islands:
            divisor, why = divisor * islands, f"{islands} islands x {why}"
        vma = self.reducer is None or checks_vma(self.reducer)
        worker_axes = (st.ISLAND, self.axis) if islands else self.axis
        virtual = vmap_workers and self.per_device > 1
        vma = vma and not virtual  # a vmap axis has no varying types

        def step(state: st.State, batch: st.Batch) -> tuple[st.State, st.Metrics]:
            st.check_batch(batch, divisor, why=why)
            one = self.one_island(abstract(state))
            state_specs = specs(one) if callable(specs) else specs
            out = state_specs if out_specs is None else out_specs
            out = out(one) if callable(out) else out
            if islands:
                state_specs, out = island_specs(state_specs), island_specs(out)

            def checked(state: st.State, batch: st.Batch) -> tuple[Any, st.Metrics]:
                new, metrics = worker_step(unstack(state) if islands else state, batch)
                if islands:  # the islands' mean, after the step's other collectives
                    # (over every axis: the token makes the metrics vary where the state does)
                    axes = tuple(self.mesh.axis_names)
                    metrics = lax.pmean(vary(after(metrics, new), axes), axes)
                    new = restack(new)
                if vma:
                    check_agrees(new, out, "the new state")
                    check_agrees(metrics, P(), "the metrics")
                return new, metrics

            program = jax.shard_map(
                _over_rows(checked, self.axis, self.per_device, state_specs, out)
                if virtual
                else checked,
                mesh=self.mesh,
                in_specs=(state_specs, P(worker_axes)),
                out_specs=(out, P()),
                check_vma=vma,
            )
            sharding = NamedSharding(self.mesh, P(worker_axes))
            batch = jax.tree.map(lambda x: jax.sharding.reshard(jnp.asarray(x), sharding), batch)
            return program(state, batch)

        return step

    def worker_index(self) -> jax.Array:
        """Inside the step's ``shard_map``: this worker's index among all workers, the
        islands' included (island i's worker w is ``i * n + w``): what keys fold in.
        With several workers a device, inside the step's ``vmap`` over them."""
        axes = (st.ISLAND, self.axis) if self.islands else self.workers_axis
        return lax.axis_index(axes)

    def device_workers(self) -> jax.Array:
        """Inside the step's ``shard_map``: the indices of this device's workers, ``[k]``
        for ``per_device`` k, in the order of its rows."""
        return lax.axis_index(self.axis) * self.per_device + jnp.arange(self.per_device)

    def one_island(self, tree: Any) -> Any:
        """Abstract shapes of one island's entry of an island-stacked state (``tree``
        itself without islands)."""
        return one_worker(tree) if self.islands else tree

    def per_island(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` over one island's state, mapped over the islands (``fn`` itself without):
        for a builder's work outside the ``shard_map``, such as ``ddl.fsdp``'s optimizer."""
        return jax.vmap(fn, spmd_axis_name=st.ISLAND) if self.islands else fn

    def over_islands(self, fn: Callable[[st.State], Any]) -> Callable[[st.State], Any]:
        """``Strategy.params`` from one island's ``fn``: ``fn`` itself without islands, else
        the mean of every island's ``fn`` (as ``local_sgd`` averages its replicas)."""
        if not self.islands:
            return fn
        return lambda state: replica_mean(self.per_island(fn)(state))

    def replicated(self, fn: Callable[[st.State], Any]) -> Callable[[st.State], Any]:
        """``fn`` jitted once (not per call), its output replicated on the user's mesh (as
        given, so that it meets the user's other arrays there)."""
        mesh = self.mesh if self.given_mesh is None else self.given_mesh
        return jax.jit(fn, out_shardings=NamedSharding(mesh, P()))

    def on_given_mesh(self, fn: Callable[[st.State], Any]) -> Callable[[st.State], Any]:
        """``fn`` whose output is replicated already: as it is where the state lives on
        the user's mesh, else moved there (``replicated``: a hand-built mesh's Auto axes,
        or axes ``prepare`` added)."""
        return fn if self.given_mesh in (None, self.mesh) else self.replicated(fn)

    def replica_variables(self) -> Callable[[st.State], Any]:
        """``Strategy.params`` of a state whose ``params`` and ``model.state`` are stacked
        per worker: the mean of the replicas, jitted once."""

        def mean(state: st.State) -> Any:
            model = state.model._replace(state=replica_mean(state.model.state))
            return self.variables(replica_mean(state.params), model)

        return self.replicated(mean)

    def variables(self, params: st.Params, model: ml.ModelVars) -> Any:
        """What ``Strategy.params`` returns: the params, with the model state if any."""
        return ml.join_variables(self.loss_fn, params, model.state)

    @property
    def value_and_grad(self) -> Callable[..., Any]:
        """``(params, model_state, batch, key) -> ((loss, aux), grads, model_state)``.

        One worker's loss and gradient on its local batch, averaged over ``accumulate``
        micro-batches visited by ``lax.scan`` with a running sum (memory holds one
        micro-batch's activations and one gradient); the model state passes through the
        micro-batches in order, and micro-batch j draws ``fold_in(key, j)``. Where
        :attr:`transposes_weight_gradients`, the weight-gradient products are laid out for
        XLA:CPU (``xla_cpu/products.py``).
        """
        fn, has_aux, stateful = ml.as_model_loss(self.loss_fn).fn, self.has_aux, self.stateful

        def one(params, model_state, batch, key):
            def loss(p):
                returned = call_loss(fn, p, model_state, batch, key)
                if not (isinstance(returned, tuple | list) and len(returned) == 2):
                    got = "an array" if hasattr(returned, "shape") else type(returned).__name__
                    raise TypeError(
                        f"loss_fn.fn must return (out, new_model_state), got {got}: a "
                        "ddl.ModelLoss returns the model state too (the one it was given, if "
                        "it has none to update)."
                    )
                out, new_state = returned
                st.check_loss_output(abstract(out), has_aux=has_aux)
                if stateful:
                    _check_returned_state(model_state, new_state)
                value, aux = out if has_aux else (out, {})
                return value, (aux, new_state)

            (value, (aux, new_state)), grads = grad(loss)(params)
            return (value, aux), grads, new_state

        def grad(loss):
            value_and_grad = jax.value_and_grad(loss, has_aux=True)
            if self.transposes_weight_gradients:
                return cpu_products.transposed_weight_gradients(value_and_grad)
            return value_and_grad

        accumulate, axis = self.accumulate, self.axis
        if accumulate == 1:
            return one

        def accumulated(params, model_state, batch, key):
            micro = jax.tree.map(lambda x: x.reshape(accumulate, -1, *x.shape[1:]), batch)
            first = jax.tree.map(lambda x: x[0], micro)
            out = jax.eval_shape(one, params, model_state, first, key)
            zeros = jax.tree.map(jnp.zeros_like, out[:2])

            def add(carry, xs):
                total, state = carry
                j, mb = xs
                (value, aux), grads, state = one(params, state, mb, jax.random.fold_in(key, j))
                return (jax.tree.map(jnp.add, total, ((value, aux), grads)), state), None

            # The state a worker's micro-batches update is its own until the strategy merges it.
            carry = (zeros, vary(model_state, (axis,)))
            (total, state), _ = lax.scan(add, carry, (jnp.arange(accumulate), micro))
            total = jax.tree.map(lambda x: x / accumulate, total)
            return (*total, state)

        return accumulated

    @property
    def stateful(self) -> bool:
        return isinstance(self.loss_fn, ml.ModelLoss)


def _over_rows(
    worker_step: Callable[..., Any], axis: str, k: int, in_specs: Any, out_specs: Any
) -> Callable[..., Any]:
    """Inside ``shard_map``: ``worker_step`` for each of the device's ``k`` workers,
    ``jax.vmap``-ped over ``VIRTUAL``. A leaf split over ``axis`` (its spec's first entry)
    holds the device's k workers' entries: each worker sees its own as ``[1, ...]``, as
    with one worker a device; the others (replicated) are shared, and must come out equal
    for every worker (a mean over ``workers_axis``, say). The batch's rows split in k."""

    def mapped(tree: Any, specs: Any) -> Any:
        full = jax.tree.broadcast(specs, tree, is_leaf=is_spec)
        return jax.tree.map(lambda _, s: 0 if len(s) and s[0] == axis else None, tree, full,
                            is_leaf=is_spec)  # fmt: skip

    def run(state: Any, batch: Any) -> Any:
        in_axes = mapped(state, in_specs)
        rows = jax.tree.map(
            lambda x, a: x if a is None else x.reshape(k, 1, *x.shape[1:]), state, in_axes
        )
        batch = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)
        vmapped = functools.partial(jax.vmap, worker_step, axis_name=st.VIRTUAL)
        if out_specs is in_specs:  # a new state, laid out as the old
            out_axes = (in_axes, None)
        else:
            shapes = jax.eval_shape(vmapped(in_axes=(in_axes, 0)), rows, batch)
            out_axes = (mapped(one_worker(shapes[0]), out_specs), None)
        try:
            new, metrics = vmapped(in_axes=(in_axes, 0), out_axes=out_axes)(rows, batch)
        except ValueError as e:  # a shared part of the state came out per worker
            if "out_axes is None" not in str(e):
                raise
            raise ValueError(
                "the new state's parts shared by a device's workers came out different for "
                f"each worker: {REDUCER_CAUSE}"
            ) from None
        new = jax.tree.map(
            lambda x, a: x if a is None else x.reshape(k, *x.shape[2:]), new, out_axes[0]
        )
        return new, metrics

    return run


def after(x: Any, tree: Any) -> Any:
    """``x`` made to wait for every leaf of ``tree`` (0 times a token read from
    each leaf's first entry is added; XLA cannot fold it, as 0 times inf or NaN is not 0).

    XLA:CPU runs independent operations of a device's program in any order: with an
    island's own collectives and one across islands independent, DES-LOC over islands
    crashed (a segmentation fault, 8 simulated devices on 2 shared cores; 0 of 6 runs
    with the chain). Chaining them keeps one order on every device.
    """
    firsts = [leaf.reshape(-1)[0] for leaf in jax.tree.leaves(tree) if leaf.size]
    token = sum((v != v).astype(jnp.float32) for v in firsts)
    return jax.tree.map(lambda a: a + (token * 0).astype(a.dtype), x)


def island_specs(specs: Any) -> Any:
    """A state's ``PartitionSpec`` prefix for its island-stacked form: each spec with a
    leading ``island`` entry."""
    return jax.tree.map(lambda s: P(st.ISLAND, *s), specs, is_leaf=is_spec)


def _copies(tree: Any, count: int) -> Any:
    """``count`` copies of ``tree`` along a new leading axis."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (count, *jnp.shape(x))), tree)


def is_spec(x: Any) -> bool:
    """Whether ``x`` is a ``PartitionSpec`` (a leaf of a spec tree, not a tuple to map over)."""
    return isinstance(x, P)


def _onto(mesh: Mesh, tree: Any) -> Any:
    """``tree`` with every array that lives on other devices than ``mesh``'s (variables
    trained on another mesh) copied onto them, replicated: a jitted ``init`` takes no
    argument from devices outside its output's."""
    devices = set(mesh.devices.flat)

    def onto(x: Any) -> Any:
        if isinstance(x, jax.Array) and x.sharding.device_set != devices:
            return jax.device_put(x, NamedSharding(mesh, P()))
        return x

    return jax.tree.map(onto, tree)


def _check_not_a_factory(reducer: Callable[..., Any]) -> None:
    """A function given as ``reducer=`` is called with the workers' axis: one of the
    library's builders whose first argument is something else (``top_k``'s ratio) was
    meant to be called first."""
    if not getattr(reducer, "__module__", "").startswith("ddl_jax."):
        return
    try:
        first = next(iter(inspect.signature(reducer).parameters), "axis")
    except (TypeError, ValueError):  # no signature to read
        return
    if first != "axis":
        name = getattr(reducer, "__name__", "the reducer")
        raise TypeError(
            f"reducer={name} is a builder taking {first} first: call it, e.g. "
            f"reducer=ddl.compression.{name}(...) (or, with workers=, reducer=lambda "
            f"axis: ddl.compression.{name}(..., axis=axis))."
        )


def call_loss(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(params, model_state, batch, key)``, its commonest mistakes named: a key that
    neither the batch nor the params hold, a traced value made concrete inside it, float
    labels."""
    params, batch = args[0], args[2]
    try:
        return fn(*args)
    except KeyError as e:
        missing = e.args[0] if e.args else None
        if isinstance(batch, dict) and isinstance(missing, str) and missing not in batch:
            where = f"the batch, which does not hold it; its keys: {sorted(batch)}"
            if isinstance(params, dict) and missing not in params:
                where = (
                    f"a key neither the batch holds (its keys: {sorted(batch)}) nor the params "
                    f"(their top level: {sorted(params)})"
                )
            raise KeyError(f"loss_fn asked for {missing!r}: {where}.") from e
        raise
    except jax.errors.ConcretizationTypeError as e:
        raise TypeError(
            "loss_fn made a traced value concrete (float(), int(), bool(), .item(), or a "
            "Python if on an array): the loss runs traced under jit. Keep it in jnp "
            "(jnp.where, jax.lax.cond) and return an array."
        ) from e
    except TypeError as e:
        if "subdtype of <class 'numpy.integer'>" not in str(e) or not isinstance(batch, dict):
            raise
        dtypes = ", ".join(f"{k!r}: {getattr(v, 'dtype', type(v).__name__)}" for k, v in
                           sorted(batch.items()))  # fmt: skip
        raise TypeError(
            f"loss_fn passed floats where a function in it expected integers (class labels, "
            f"e.g. optax's *_with_integer_labels); the batch holds {{{dtypes}}}. Give the "
            "labels as integers: labels.astype(jnp.int32) in the loss or in the data."
        ) from e


#: What :func:`check_agrees` blames by default: the reducer.
REDUCER_CAUSE = (
    "the reducer's output must be. A reducer must average over the workers (e.g. "
    "ddl.allreduce_mean()); allreduce_mean(algorithm='ring'|'tree'|'ps') inside optax.chain "
    "loses the mark that lets strategies run its ppermute rounds: chain it with ddl.chain "
    "instead."
)


def check_agrees(tree: Any, specs: Any, what: str, cause: str = REDUCER_CAUSE) -> None:
    """Each leaf of a worker step's output typed the same on every worker of each mesh axis
    its spec does not split it over (what ``shard_map`` needs to return it so); ``cause``
    says what to fix where one is not."""
    full = jax.tree.broadcast(specs, tree, is_leaf=is_spec)
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    for (path, leaf), spec in zip(leaves, jax.tree.leaves(full, is_leaf=is_spec), strict=True):
        split = {
            a for names in spec if names for a in ((names,) if isinstance(names, str) else names)
        }
        varying = jax.typeof(leaf).manual_axis_type.varying - split
        if varying:
            raise ValueError(
                f"{what}{jax.tree_util.keystr(path)} is not provably the same on "
                f"every worker of {sorted(varying)}: {cause}"
            )


def _check_model_state(model_state: Any) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(model_state):
        if not hasattr(leaf, "dtype"):
            raise TypeError(
                f"model state must be a pytree of arrays; variables{jax.tree_util.keystr(path)} "
                f"is {type(leaf).__name__}."
            )


def _check_returned_state(before: Any, after: Any) -> None:
    if jax.tree.structure(before) != jax.tree.structure(after) or any(
        jnp.shape(a) != jnp.shape(b)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    ):
        raise ValueError(
            "the loss returned a model state of another structure than it received: got "
            f"{jax.tree.map(jnp.shape, after)}, expected {jax.tree.map(jnp.shape, before)}. "
            "Return the updated collections with the same keys and shapes."
        )


def _check_no_unused_axis(mesh: Mesh, used: tuple[str, ...]) -> None:
    """Refuses a mesh axis of size > 1 the strategy does not use: its devices would hold
    redundant copies doing the same work (a size-1 axis costs nothing and is accepted)."""
    if st.ISLAND in mesh.axis_names and st.ISLAND not in used:
        raise ValueError(
            f"the mesh has an {st.ISLAND!r} axis, which this strategy does not take: islands "
            "are for an outer method over an inner strategy, "
            "ddl.local_sgd(inner=ddl.fsdp(loss_fn, optimizer, mesh), period=...), whose inner "
            "strategy is ddl.data_parallel, ddl.fsdp or ddl.tensor_parallel. Build the mesh "
            "without island= for this strategy."
        )
    for name in mesh.axis_names:
        if name not in used and mesh.shape[name] > 1:
            raise ValueError(
                f"mesh axis {name!r} (size {mesh.shape[name]}) is not one this strategy uses: "
                f"it uses {list(dict.fromkeys(used))}, and every device along {name!r} would "
                "repeat the same work. Build the mesh over those axes only."
            )


def _check_optimizer_is_local(optimizer: optax.GradientTransformation, mesh: Mesh) -> None:
    """Refuses an optimizer that communicates over a mesh axis: a reducer given as (or
    chained into) ``optimizer=`` would reduce the reduced gradient again, or replace the
    strategy's own exchange (local SGD's), silently. Traced on a probe parameter; an
    optimizer that needs the model's own tree (labels, masks) is not checked."""
    probe = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}

    def update(g: Any) -> Any:
        return optimizer.update(g, optimizer.init(g), g)[0]

    program = jax.shard_map(update, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    try:
        axes = axes_communicated(jax.make_jaxpr(program)(probe))
    except Exception:  # the probe is not this optimizer's tree: nothing to tell
        return
    if axes:
        raise ValueError(
            f"optimizer communicates over {sorted(axes)} (a ddl.allreduce_mean or "
            "ddl.compression reducer in it?): a strategy reduces each worker's gradient with "
            "its reducer= and then runs the optimizer on the result; give the reducer as "
            "reducer=, and an optimizer that acts on one worker's values."
        )


def prepare(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    axis: str = st.DATA,
    accumulate: int = 1,
    has_aux: bool = False,
    *,
    add_axes: tuple[str, ...] = (),
    reducer: optax.GradientTransformation | None = None,
    default_reducer: Callable[[str], optax.GradientTransformation] | None = None,
    islands: bool = False,
    workers: int | None = None,
) -> Kit:
    """The builder preamble: checks the shared arguments and prepares the mesh.

    Args:
      loss_fn: ``(params, batch) -> loss`` or a ``ddl.ModelLoss``.
      optimizer: an optax transform.
      mesh: a ``jax.sharding.Mesh`` holding ``axis`` (unless ``axis`` is in ``add_axes``).
      axis: the worker axis.
      add_axes: axes the builder works on that the mesh may lack (they count as size 1).
      reducer: the user's reducer, a function of the workers' axis returning one (called
        with ``Kit.workers_axis``: with ``workers=``, ``(axis, VIRTUAL)``), or ``None`` for
        ``default_reducer(workers_axis)``.
      default_reducer: the builder's default reducer (``ddl.allreduce_mean``), a function
        of the axis; ``None`` for a builder that takes no reducer.
      accumulate: micro-batches per worker per gradient, >= 1.
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)``.
      islands: whether the builder can run once per island on a mesh with an ``island``
        axis (the module's docstring); others refuse such a mesh.
      workers: for a builder that runs several workers on a device, how many in all: a
        multiple of the size of ``axis`` (``None``: one a device).
    """
    if isinstance(loss_fn, ml.ModelLoss):
        ml.check_model_loss(loss_fn)
    elif not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (params, batch) -> loss, got {loss_fn!r}.")
    st.check_transform("optimizer", optimizer, "optax.adam(1e-3)")
    if reducer is not None and hasattr(reducer, "update"):
        st.check_transform(
            "reducer", reducer, "ddl.allreduce_mean() or ddl.compression.top_k(0.01)"
        )
    elif reducer is not None and not callable(reducer):
        raise TypeError(
            "reducer must be an optax.GradientTransformation (ddl.compression.top_k(0.01)) "
            f"or a function of the workers' axis returning one; got {reducer!r}."
        )
    elif reducer is not None:
        _check_not_a_factory(reducer)
    if isinstance(reducer, ScatterReducer):
        raise ValueError(
            "reducer: a scatter reducer (ddl.compression.scatter_*) reduce-scatters the "
            "gradient's chunks for ddl.fsdp at stages 2 and 3; this strategy all-reduces: "
            "give it ddl.allreduce_mean(), or where it takes one (not tensor_parallel) a "
            "compressor such as ddl.compression.cast(...)."
        )
    accumulate = st.check_int("accumulate", accumulate, minimum=1)
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, got {has_aux!r}.")
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (see ddl.make_mesh), got {type(mesh).__name__}."
        )
    if axis not in add_axes:
        st.check_mesh_axis(mesh, axis)
    on_islands = islands and st.ISLAND in mesh.axis_names
    _check_no_unused_axis(mesh, (axis, *add_axes, *((st.ISLAND,) if on_islands else ())))
    given, mesh = mesh, explicit_mesh(mesh, add_axes)
    islands = mesh.shape[st.ISLAND] if on_islands else 0
    devices = mesh.shape[axis]
    n = devices if workers is None else st.check_int("workers", workers, minimum=1)
    if n % devices:
        raise ValueError(
            f"workers={n} must be a multiple of the {devices} devices on axis {axis!r} (each "
            f"device runs workers / {devices} of them), e.g. "
            f"workers={devices * max(n // devices, 1)}."
        )
    _check_optimizer_is_local(optimizer, mesh)
    kit = Kit(mesh, axis, n, None, loss_fn, has_aux, accumulate, islands, n // devices, given)
    if islands and kit.per_device > 1:
        raise ValueError(
            f"workers={n} runs several workers a device, which islands do not: give one "
            "worker a device (workers=None) with an island axis."
        )
    if reducer is None and default_reducer is not None:
        reducer = default_reducer(kit.workers_axis)
    elif reducer is not None and not hasattr(reducer, "update"):  # a function of the axis
        reducer = reducer(kit.workers_axis)
        st.check_transform("reducer(axis)", reducer, "ddl.compression.top_k(0.01, axis=axis)")
    elif reducer is not None and kit.per_device > 1:
        raise ValueError(
            f"reducer= with workers={n} on {devices} devices: a reducer built for axis "
            f"{axis!r} averages one worker a device. Give it as a function of the axis, which "
            "the strategy calls with the one over every worker: reducer=lambda axis: "
            "ddl.compression.top_k(0.01, axis=axis)."
        )
    return kit._replace(reducer=reducer)
