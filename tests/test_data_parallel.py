"""data_parallel against single-device training on the global batch."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, reference_sgd, worker_shards
from conftest import train as run
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl
from ddl_jax._src.measure.comm import collectives
from ddl_jax._src.reduce import allreduce as reducers
from ddl_jax._src.xla_cpu import tunings

OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_equals_single_device_training_on_the_global_batch(mlp, n, opt):
    loss_fn, params = mlp
    batches = make_batches(5, 32)
    strategy = ddl.data_parallel(loss_fn, OPTIMIZERS[opt](), ddl.make_mesh(data=n))
    state, _ = run(strategy, params, batches)
    expected = reference_sgd(loss_fn, OPTIMIZERS[opt](), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "ps"])
def test_every_allreduce_algorithm_equals_single_device_training(mlp, n, algorithm):
    loss_fn, params = mlp
    batches = make_batches(3, 48)
    reducer = ddl.allreduce_mean(algorithm=algorithm)
    strategy = ddl.data_parallel(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=n), reducer=reducer)
    state, _ = run(strategy, params, batches)
    expected = reference_sgd(loss_fn, optax.adam(1e-2), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_accumulate_equals_one_step_on_the_whole_batch(mlp, n, opt):
    loss_fn, params = mlp
    batches = make_batches(5, 64)
    strategy = ddl.data_parallel(loss_fn, OPTIMIZERS[opt](), ddl.make_mesh(data=n), accumulate=4)
    state, _ = run(strategy, params, batches)
    expected = reference_sgd(loss_fn, OPTIMIZERS[opt](), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)


def test_metrics_are_means_over_the_global_batch(mlp):
    loss_fn, params = mlp

    def with_aux(params, batch):
        loss = loss_fn(params, batch)
        return loss, {"x_mean": batch["x"].mean(), "twice_loss": 2 * loss}

    [batch] = make_batches(1, 32)
    strategy = ddl.data_parallel(
        with_aux, optax.sgd(0.1), ddl.make_mesh(data=8), has_aux=True, accumulate=2
    )
    _, metrics = run(strategy, params, [batch])
    loss = loss_fn(params, batch)
    chex.assert_trees_all_close(
        metrics, {"loss": loss, "x_mean": batch["x"].mean(), "twice_loss": 2 * loss}, atol=1e-6
    )


def test_state_placement_params_replicated_reducer_state_per_worker(mlp):
    """A stateful reducer keeps one state per worker: here, the sum of its own gradients."""
    loss_fn, params = mlp

    def sum_own_grads_then_mean():
        def init(params):
            return jax.tree.map(jnp.zeros_like, params)

        def update(grads, state, params=None):
            return jax.lax.pmean(grads, "data"), jax.tree.map(jnp.add, state, grads)

        return optax.GradientTransformation(init, update)

    n, batches = 4, make_batches(2, 16)
    mesh = ddl.make_mesh(data=n)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.0), mesh, reducer=sum_own_grads_then_mean())
    state, _ = run(strategy, params, batches)

    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state.params))
    for x in jax.tree.leaves(state.reducer_state):
        assert x.shape[0] == n and x.sharding.spec[0] == "data"
    for w in range(n):  # worker w saw rows [4w, 4w+4) of every batch
        own = [worker_shards(b, n)[w] for b in batches]
        expected = jax.tree.map(lambda *g: sum(g), *[jax.grad(loss_fn)(params, b) for b in own])
        chex.assert_trees_all_close(
            jax.tree.map(lambda x, w=w: np.asarray(x)[w], state.reducer_state), expected, atol=1e-6
        )


@pytest.mark.parametrize("accumulate", [1, 4])
def test_compiled_step_holds_one_all_reduce_of_the_gradient_size(mlp, accumulate):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(
        loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), accumulate=accumulate
    )
    state = strategy.init(params)
    [batch] = make_batches(1, 64)
    hlo = jax.jit(strategy.step).lower(state, batch).compile().as_text()
    ops = collectives(hlo)
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    loss_bytes = 4  # the float32 loss metric rides in the same all-reduce
    assert [op.kind for op in ops] == ["all-reduce"]
    assert ops[0].count == 1  # once per step, not inside the accumulation loop
    assert ops[0].nbytes == grad_bytes + loss_bytes


def test_batch_not_divisible_by_workers_is_rejected_at_the_call(mlp):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), accumulate=2)
    state = strategy.init(params)
    [batch] = make_batches(1, 24)
    with pytest.raises(ValueError, match=r"24 is not divisible by 16 .*8 workers.*accumulate=2"):
        jax.jit(strategy.step)(state, batch)


def test_batch_leaves_must_agree_on_the_batch_size(mlp):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    state = strategy.init(params)
    [batch] = make_batches(1, 8)
    batch["y"] = batch["y"][:4]
    with pytest.raises(ValueError, match="disagree on the batch size"):
        strategy.step(state, batch)


def test_mesh_without_the_axis_is_rejected(mlp):
    loss_fn, _ = mlp
    mesh = jax.make_mesh((8,), ("workers",))
    with pytest.raises(ValueError, match=r"axis='data' is not an axis .*\['workers'\]"):
        ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        ddl.data_parallel(loss_fn, optax.sgd(0.1), "data")


def test_reducer_on_an_axis_the_mesh_lacks_is_rejected(mlp):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(
        loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), reducer=ddl.allreduce_mean("dp")
    )
    with pytest.raises(ValueError, match=r"axis='dp' is not an axis .*\['data'\]"):
        strategy.step(strategy.init(params), make_batches(1, 8)[0])


def test_non_scalar_loss_is_rejected_at_the_call(mlp):
    _, params = mlp
    strategy = ddl.data_parallel(
        lambda p, b: jnp.sum(b["x"], axis=1), optax.sgd(0.1), ddl.make_mesh(data=8)
    )
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar loss.*\(1,\)"):
        jax.jit(strategy.step)(strategy.init(params), make_batches(1, 8)[0])


def test_a_loss_declared_with_aux_that_returns_the_loss_alone_says_what_it_returned(mlp):
    _, params = mlp
    strategy = ddl.data_parallel(
        lambda p, b: jnp.mean(b["x"]), optax.sgd(0.1), ddl.make_mesh(data=8), has_aux=True
    )
    with pytest.raises(TypeError, match=r"\(loss, aux_dict\); it returned one array, float32\[\]"):
        jax.jit(strategy.step)(strategy.init(params), make_batches(1, 8)[0])


@pytest.mark.parametrize(
    ("aux", "match"),
    [
        (jnp.ones(3), r"aux\['acc'\] must be a floating-point scalar"),
        (jnp.int32(3), r"aux\['acc'\] must be a floating-point scalar"),
    ],
)
def test_aux_values_must_be_float_scalars(mlp, aux, match):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(
        lambda p, b: (loss_fn(p, b), {"acc": aux}),
        optax.sgd(0.1),
        ddl.make_mesh(data=8),
        has_aux=True,
    )
    with pytest.raises(ValueError, match=match):
        strategy.step(strategy.init(params), make_batches(1, 8)[0])


def test_an_nnx_module_as_params_points_at_the_flax_bridge(mlp):
    loss_fn, _ = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    module = ddl.models.MLP(12, [16], 5, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="NNX module .*ddl.flax.loss_from_module"):
        strategy.init(module)


def test_tuple_loss_without_has_aux_points_at_has_aux(mlp):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(
        lambda p, b: (loss_fn(p, b), {}), optax.sgd(0.1), ddl.make_mesh(data=8)
    )
    with pytest.raises(ValueError, match="has_aux=True"):
        strategy.step(strategy.init(params), make_batches(1, 8)[0])


@pytest.mark.parametrize(
    ("params", "where"),
    [
        ({"w": [1, 2]}, r"params\['w'\]\[0\] is int"),
        ({"w": np.arange(3)}, r"params\['w'\] is int64"),
        ({"w": "weights"}, r"params\['w'\] is str"),
        ({"w": np.float32(0.5)}, r"params\['w'\] is a NumPy scalar \(float32\): wrap it"),
        ({"w": jnp.ones(3, jnp.complex64)}, r"params\['w'\] is complex64 \(split a complex"),
        ({}, "no leaves"),
    ],
)
def test_params_that_are_not_float_arrays_are_rejected(mlp, params, where):
    loss_fn, _ = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    with pytest.raises(TypeError, match=where):
        strategy.init(params)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"accumulate": 0}, ValueError, "accumulate must be an int >= 1"),
        ({"reducer": "psum"}, TypeError, "reducer must be an optax.GradientTransformation"),
        ({"optimizer": "adam"}, TypeError, "optimizer must be an optax.GradientTransformation"),
        ({"loss_fn": 3}, TypeError, "loss_fn must be callable"),
    ],
)
def test_bad_builder_arguments(mlp, kwargs, error, match):
    loss_fn, _ = mlp
    args = {"loss_fn": loss_fn, "optimizer": optax.sgd(0.1), "mesh": ddl.make_mesh(data=2)}
    with pytest.raises(error, match=match):
        ddl.data_parallel(**{**args, **kwargs})


def test_allreduce_mean_rejects_unknown_algorithm():
    with pytest.raises(
        ValueError, match=r"algorithm='ring2' is not known; valid: \['psum', 'ring', 'tree', 'ps'\]"
    ):
        ddl.allreduce_mean(algorithm="ring2")


def test_a_chain_clips_each_workers_gradient_before_the_ring(mlp):
    loss_fn, params = mlp
    n, batches = 4, make_batches(3, 32)
    reducer = ddl.chain(optax.clip_by_global_norm(0.05), ddl.allreduce_mean(algorithm="ring"))
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.5), ddl.make_mesh(data=n), reducer=reducer)
    state, _ = run(strategy, params, batches)
    expected = jax.tree.map(jnp.array, params)
    for batch in batches:
        grads = [jax.grad(loss_fn)(expected, shard) for shard in worker_shards(batch, n)]
        norms = [optax.tree.norm(g) for g in grads]
        assert min(norms) > 0.05  # the clip binds, so the order of clip and mean matters
        clipped = [
            jax.tree.map(lambda x, s=s: x * 0.05 / s, g) for g, s in zip(grads, norms, strict=True)
        ]
        mean = jax.tree.map(lambda *xs: sum(xs) / n, *clipped)
        expected = jax.tree.map(lambda p, g: p - 0.5 * g, expected, mean)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-6)


@pytest.mark.parametrize(
    "reducer",
    [
        # an explicit ppermute algorithm's mark is lost (compressors chain freely)
        optax.chain(optax.clip(1.0), ddl.allreduce_mean(algorithm="ring")),
        optax.identity(),  # no reduction at all: workers would silently diverge
    ],
    ids=["optax_chain_of_a_ring", "identity"],
)
def test_a_reducer_that_does_not_provably_agree_is_a_clear_error(mlp, reducer):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=4), reducer=reducer)
    with pytest.raises(ValueError, match="not provably the same on every worker.*ddl.chain"):
        jax.jit(strategy.step)(strategy.init(params), make_batches(1, 32)[0])


@pytest.mark.parametrize("build", [ddl.data_parallel, lambda *a: ddl.local_sgd(*a, period=1)])
def test_a_hand_built_mesh_with_auto_axes_works(mlp, build):
    loss_fn, params = mlp
    batches = make_batches(3, 32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))  # Auto axis types
    state, _ = run(build(loss_fn, optax.sgd(0.1), mesh), params, batches)
    expected = reference_sgd(loss_fn, optax.sgd(0.1), params, batches)
    chex.assert_trees_all_close(
        build(loss_fn, optax.sgd(0.1), mesh).params(state), expected, atol=1e-5
    )


@pytest.mark.parametrize("bucket_mb", [None, 1e-5, 0.002, 25])
def test_allreduce_mean_buckets_equal_pmean(bucket_mb):
    """Any bucket size gives lax.pmean of every leaf, float32 and bfloat16 alike."""
    n = 4
    mesh = ddl.make_mesh(data=n)
    rng = np.random.default_rng(0)
    shapes = [(30, 20), (20,), (), (7, 3, 2)]
    tree = {
        "f32": [rng.normal(size=(n, *s)).astype(np.float32) for s in shapes],
        "bf16": [rng.normal(size=(n, *s)).astype(jnp.bfloat16) for s in shapes],
    }
    tree = jax.device_put(tree, NamedSharding(mesh, P("data")))
    reducer = ddl.allreduce_mean(bucket_mb=bucket_mb)

    def per_worker(fn):
        def body(t):
            out = fn(jax.tree.map(lambda x: x[0], t))
            return jax.tree.map(lambda x: x[None], out)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))

    got = per_worker(lambda t: reducer.update(t, reducer.init(t))[0])(tree)
    want = per_worker(lambda t: jax.lax.pmean(t, "data"))(tree)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_gradients_travel_in_buckets(mlp, monkeypatch):
    """The compiled step's all-reduces carry one buffer per bucket (XLA:CPU's gloo makes
    one call per buffer), not one per parameter leaf."""
    loss_fn, params = mlp
    leaves = jax.tree.leaves(params)
    biggest = max(x.nbytes for x in leaves)
    batch = {"x": np.zeros((32, 12), np.float32), "y": np.zeros(32, np.int32)}
    mesh = ddl.make_mesh(data=4)

    def buffers(bucket_mb):
        reducer = ddl.allreduce_mean(bucket_mb=bucket_mb)
        strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer=reducer)
        stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
        return sum(op.buffers for op in stats.ops if op.kind == "all-reduce")

    total = sum(x.nbytes for x in leaves)
    assert buffers(None) == len(leaves) + 1  # + the loss
    assert buffers(25) == 1 + 1
    # "auto": leaf by leaf in one process, and on a CPU cluster by default; buckets on a
    # CPU cluster with the XLA:CPU tunings on.
    assert buffers("auto") == len(leaves) + 1
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setitem(tunings._state, "switch", False)
    assert reducers.default_bucket_bytes() is None
    assert buffers("auto") == len(leaves) + 1
    monkeypatch.setitem(tunings._state, "switch", True)
    assert reducers.default_bucket_bytes() == 25 * 2**20
    assert buffers("auto") == 1 + 1
    # Buckets fill in leaf order up to the cap; a leaf beyond the cap travels alone.
    cap = max(biggest, total // 2)
    expected, size = 1, 0
    for x in leaves:
        if size and size + x.nbytes > cap:
            expected, size = expected + 1, 0
        size += x.nbytes
    assert 1 < expected < len(leaves)
    assert buffers(cap / 2**20) == expected + 1


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), "25", "Auto", True])
def test_allreduce_mean_rejects_a_bad_bucket_size(bad):
    with pytest.raises(ValueError, match="bucket_mb"):
        ddl.allreduce_mean(bucket_mb=bad)


def test_a_loss_asking_for_a_batch_key_it_lacks_names_it(mlp):
    loss_fn, params = mlp  # reads batch["x"] and batch["y"]
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=4))
    batch = {"x": np.zeros((8, 12), np.float32), "label": np.zeros(8, np.int32)}
    with pytest.raises(KeyError, match=r"asked for 'y': a key neither the batch holds \(its "):
        strategy.step(strategy.init(params), batch)
    wrong = ddl.data_parallel(lambda p, b: b["x"] @ p["W"], optax.sgd(0.1), ddl.make_mesh(data=4))
    with pytest.raises(KeyError, match=r"'W': .*nor the params \(their top level: \['w'\]\)"):
        wrong.step(wrong.init({"w": np.zeros(12, np.float32)}), batch)


def test_float_inside_the_loss_is_one_line_naming_the_loss():
    def loss_fn(params, batch):
        return float(jnp.mean((batch["x"] @ params["w"]) ** 2))

    params = {"w": jnp.ones((3, 1))}
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=4))
    with pytest.raises(TypeError, match=r"loss_fn made a traced value concrete \(float\(\)"):
        strategy.step(strategy.init(params), {"x": np.ones((8, 3), np.float32)})


def test_float_labels_are_named_with_the_batchs_dtypes(mlp):
    loss_fn, params = mlp  # optax's cross-entropy with integer labels on batch["y"]
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=4))
    batch = {"x": np.zeros((8, 12), np.float32), "y": np.zeros(8, np.float32)}
    with pytest.raises(TypeError, match=r"expected integers .*'y': float32.*astype\(jnp.int32\)"):
        strategy.step(strategy.init(params), batch)


@pytest.mark.parametrize("name", ["loss", "synchronised", "synchronised_mu", "eval_acc"])
def test_aux_names_that_metrics_take_are_refused(mlp, name):
    """An aux value named as a metric the strategies or ddl.fit write would replace it (a
    constant "loss" hid a nan from fit) or be replaced: refused, naming it."""
    loss_fn, params = mlp
    strategy = ddl.local_sgd(
        lambda p, b: (loss_fn(p, b), {name: jnp.float32(1.0)}),
        optax.sgd(0.1),
        ddl.make_mesh(data=8),
        period=2,
        has_aux=True,
    )
    with pytest.raises(ValueError, match=rf"aux names \['{name}'\] are metrics .* aux_{name}"):
        strategy.step(strategy.init(params), make_batches(1, 8)[0])
