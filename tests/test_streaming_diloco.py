"""streaming_diloco against DiLoCo in its trivial case, and against its definition written
out in numpy for N workers, fragments in turn, an overlapped outer gradient and mixing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import bn_dropout_pair, make_batches, train_steps, worker_shards

import ddl_jax as ddl
from ddl_jax._src.strategies.streaming_diloco import fragment_indices

NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)


def test_one_fragment_without_overlap_is_diloco_step_by_step():
    """With batch statistics and dropout: the model state is averaged at the same steps."""
    loss_fn, variables = bn_dropout_pair()
    mesh, batches = ddl.make_mesh(data=8), make_batches(6, 32)
    inner = optax.adamw(1e-2)
    diloco = ddl.local_sgd(loss_fn, inner, mesh, period=2, outer_optimizer=NESTEROV)
    streaming = ddl.streaming_diloco(
        loss_fn, inner, mesh, period=2, fragments=1, outer_optimizer=NESTEROV
    )
    step_a, step_b = jax.jit(diloco.step), jax.jit(streaming.step)
    a, b = diloco.init(variables), streaming.init(variables)
    for t, batch in enumerate(batches):
        a, metrics_a = step_a(a, batch)
        b, metrics_b = step_b(b, batch)
        for name in ("loss", "synchronised"):
            np.testing.assert_allclose(metrics_b[name], metrics_a[name], atol=1e-6, err_msg=name)
        assert float(metrics_b["fragment"]) == (0.0 if t % 2 else -1.0)
        chex.assert_trees_all_close(b.params, a.params, atol=1e-6)
        chex.assert_trees_all_close(b.model.state, a.model.state, atol=1e-6)
    chex.assert_trees_all_close(b.anchor, a.anchor, atol=1e-6)
    chex.assert_trees_all_close(streaming.params(b), diloco.params(a), atol=1e-6)
    for leaf in jax.tree.leaves((b.params, b.model.state)):  # the last step synchronised
        leaf = np.asarray(leaf)
        assert (leaf == leaf[0]).all()


def quadratic_loss(params, batch):
    residual = batch["x"] @ params["a"] + batch["z"] @ params["b"] - batch["y"]
    return 0.5 * jnp.mean(residual**2)


def inner_steps(replicas, momenta, batch, names):
    """Each worker's inner step on ``quadratic_loss`` in numpy: SGD with momentum 0.5 (lr
    0.1) on its rows of ``batch``, in place."""
    for i, rows in enumerate(worker_shards(batch, len(replicas))):
        x, z, y = (np.asarray(rows[k], np.float64) for k in ("x", "z", "y"))
        r = x @ replicas[i]["a"] + z @ replicas[i]["b"] - y
        grads = {"a": x.T @ r / len(y), "b": z.T @ r / len(y)}
        for k in names:
            momenta[i][k] = grads[k] + 0.5 * momenta[i][k]
            replicas[i][k] = replicas[i][k] - 0.1 * momenta[i][k]


def reference_streaming_diloco(
    params, batches, *, n, period, fragments, overlap, mix, names=("a", "b")
):
    """Streaming DiLoCo on ``quadratic_loss`` in numpy, one fragment per leaf (fragment p
    is ``names[p]``): inner SGD with momentum 0.5 (lr 0.1) per worker on its rows; fragment p sent
    after the local steps s = p H/P (mod H); its mean outer gradient lands ``overlap``
    steps later through Nesterov SGD (0.7, 0.9) and is mixed into every replica."""
    assert fragments == len(names)
    replicas = [{k: np.array(v, np.float64) for k, v in params.items()} for _ in range(n)]
    momenta = [{k: np.zeros_like(v) for k, v in r.items()} for r in replicas]
    anchor = {k: np.array(v, np.float64) for k, v in params.items()}
    traces = {k: np.zeros_like(v) for k, v in anchor.items()}
    in_flight, sent = {}, []  # landing step -> (name, mean outer gradient)
    for t, batch in enumerate(batches):
        s = t + 1
        inner_steps(replicas, momenta, batch, names)
        due = [p for p in range(fragments) if (s - p * period // fragments) % period == 0]
        sent.append(due[0] if due else -1)
        for p in due:
            k = names[p]
            in_flight[s + overlap] = (k, np.mean([anchor[k] - r[k] for r in replicas], axis=0))
        if s in in_flight:
            k, delta = in_flight.pop(s)
            traces[k] = delta + 0.9 * traces[k]
            anchor[k] = anchor[k] - 0.7 * (delta + 0.9 * traces[k])
            for r in replicas:
                r[k] = mix * r[k] + (1 - mix) * anchor[k]
    return replicas, anchor, sent


def quadratic_batches(count, size, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(size, 3)).astype(np.float32),
            "z": rng.normal(size=(size, 3)).astype(np.float32),
            "y": rng.normal(size=size).astype(np.float32),
        }
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    ("overlap", "mix", "fragments", "names"),
    [
        (1, 0.5, 2, ("a", "b")),
        (0, 0.0, 2, ("a", "b")),
        (1, 0.5, [["b"], ["a"]], ("b", "a")),  # an explicit list: "b" is fragment 0
    ],
)
def test_matches_its_definition_written_out_in_numpy(overlap, mix, fragments, names):
    n, period = 4, 4
    params = {"a": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.asarray([0.0, 0.5, -0.4])}
    batches = quadratic_batches(13, 8)  # 3 periods and one step: a fragment in flight
    strategy = ddl.streaming_diloco(
        quadratic_loss,
        optax.sgd(0.1, momentum=0.5),
        ddl.make_mesh(data=n),
        period=period,
        fragments=fragments,
        overlap=overlap,
        mix=mix,
        outer_optimizer=NESTEROV,
    )
    state, history = train_steps(strategy, params, batches)
    replicas, anchor, sent = reference_streaming_diloco(
        params, batches, n=n, period=period, fragments=2, overlap=overlap, mix=mix, names=names
    )
    assert [int(m["fragment"]) for m in history] == sent == [-1, 1, -1, 0] * 3 + [-1]
    assert [float(m["synchronised"]) for m in history] == [float(p >= 0) for p in sent]
    stacked = {k: np.stack([r[k] for r in replicas]) for k in anchor}
    chex.assert_trees_all_close(state.params, stacked, atol=1e-5)
    chex.assert_trees_all_close(state.anchor, anchor, atol=1e-5)


def reference_torchft(params, batches, *, n, sync_every, delay, alpha, names=("a", "b")):
    """pytorch/torchft ``torchft/local_sgd.py`` (``DiLoCo``, commit 73dafea) on
    ``quadratic_loss`` in numpy, one fragment per leaf (``model_fragments`` in ``names``'
    order), inner SGD with momentum 0.5 (lr 0.1), outer Nesterov SGD (0.7, 0.9):
    ``_step_post_hook`` counts local steps; at ``sync_every / P - delay`` the fragment
    ``manager step % P`` prepares (``Delta = original - local``, averaged); at
    ``sync_every / P`` it syncs (the outer step on the restored original, then
    ``lerp_(local, alpha)``), the count restarts and the manager's step advances."""
    replicas = [{k: np.array(v, np.float64) for k, v in params.items()} for _ in range(n)]
    momenta = [{k: np.zeros_like(v) for k, v in r.items()} for r in replicas]
    original = {k: np.array(v, np.float64) for k, v in params.items()}
    buffers = {k: np.zeros_like(v) for k, v in original.items()}
    per_fragment = sync_every // len(names)
    local_step, manager_step, prepared, sent = 0, 0, None, []
    for batch in batches:
        inner_steps(replicas, momenta, batch, names)
        local_step += 1
        k = names[manager_step % len(names)]
        sent.append(-1)
        if local_step == per_fragment - delay:  # prepare_sync
            prepared = np.mean([original[k] - r[k] for r in replicas], axis=0)
            sent[-1] = manager_step % len(names)
        if local_step == per_fragment:  # perform_sync
            buffers[k] = prepared + 0.9 * buffers[k]
            original[k] = original[k] - 0.7 * (prepared + 0.9 * buffers[k])
            for r in replicas:
                r[k] = original[k] + alpha * (r[k] - original[k])
            local_step, manager_step = 0, manager_step + 1
    return replicas, original, sent


@pytest.mark.parametrize(("overlap", "mix"), [(1, 0.5), (0, 0.0)])
def test_the_torchft_schedule_matches_torchft_written_out_in_numpy(overlap, mix):
    n, period = 4, 4
    params = {"a": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.asarray([0.0, 0.5, -0.4])}
    batches = quadratic_batches(13, 8)
    strategy = ddl.streaming_diloco(
        quadratic_loss,
        optax.sgd(0.1, momentum=0.5),
        ddl.make_mesh(data=n),
        period=period,
        fragments=2,
        overlap=overlap,
        mix=mix,
        schedule="torchft",
        outer_optimizer=NESTEROV,
    )
    state, history = train_steps(strategy, params, batches)
    replicas, anchor, sent = reference_torchft(
        params, batches, n=n, sync_every=period, delay=overlap, alpha=mix
    )
    expected = [0, -1, 1, -1] * 3 + [0] if overlap else [-1, 0, -1, 1] * 3 + [-1]
    assert [int(m["fragment"]) for m in history] == sent == expected
    stacked = {k: np.stack([r[k] for r in replicas]) for k in anchor}
    chex.assert_trees_all_close(state.params, stacked, atol=1e-5)
    chex.assert_trees_all_close(state.anchor, anchor, atol=1e-5)


def test_a_checkpoint_with_a_fragment_in_flight_resumes_the_same_run(tmp_path):
    params = {"a": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.asarray([0.0, 0.5, -0.4])}
    batches = quadratic_batches(7, 8, seed=1)
    strategy = ddl.streaming_diloco(
        quadratic_loss,
        optax.adam(1e-2),
        ddl.make_mesh(data=4),
        period=4,
        fragments=2,
        overlap=1,
        mix=0.5,
        outer_optimizer=NESTEROV,
    )
    step = jax.jit(strategy.step)
    state = strategy.init(params)
    for batch in batches[:4]:  # fragment 0 is sent after step 3 and lands after step 4
        state, _ = step(state, batch)
    with ddl.checkpoint.checkpoint_manager(tmp_path) as manager:
        ddl.checkpoint.save(manager, 4, state)
    with ddl.checkpoint.checkpoint_manager(tmp_path) as manager:
        resumed, _ = ddl.checkpoint.restore_latest(manager, strategy.init(params))
    chex.assert_trees_all_equal(jax.device_get(resumed), jax.device_get(state))
    for batch in batches[4:]:
        state, _ = step(state, batch)
        resumed, _ = step(resumed, batch)
    chex.assert_trees_all_equal(resumed, state)


def toy_loss(params, batch):
    return sum(jnp.mean((batch["x"] @ w) ** 2) for w in jax.tree.leaves(params))


def test_peak_bytes_per_step_are_diloco_s_over_the_fragment_count():
    """Each fragment's send is its own branch; the largest is 1/P of DiLoCo's one branch."""
    n, period = 8, 4
    params = {f"w{i}": jnp.zeros((16, 16)) for i in range(4)}  # balanced leaves
    batch = {"x": np.ones((n, 16), np.float32)}
    mesh, inner = ddl.make_mesh(data=n), optax.sgd(0.1)

    def branches(strategy):
        stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
        assert stats.bytes_by_kind == {"all-reduce": 2 * (n - 1) / n * 4}  # the loss only
        return sorted(stats.branches.values())

    diloco = max(
        branches(ddl.local_sgd(toy_loss, inner, mesh, period=period, outer_optimizer=NESTEROV))
    )
    assert diloco == 2 * (n - 1) / n * 4 * 4 * 16 * 16
    for fragments in (2, 4):
        sends = branches(
            ddl.streaming_diloco(
                toy_loss,
                inner,
                mesh,
                period=period,
                fragments=fragments,
                overlap=period // fragments - 1,
                outer_optimizer=NESTEROV,
            )
        )
        assert len(sends) == fragments  # one branch per fragment; landings send nothing
        assert max(sends) / diloco == pytest.approx(1 / fragments, rel=0.05)


def test_a_compressing_reducer_quantizes_the_outer_gradients():
    n = 4
    params = {f"w{i}": jnp.full((8, 8), 0.1) for i in range(2)}
    batches = [{"x": np.ones((n, 8), np.float32)}] * 4
    strategy = ddl.streaming_diloco(
        toy_loss,
        optax.sgd(0.1),
        ddl.make_mesh(data=n),
        period=4,
        fragments=2,
        reducer=ddl.compression.cast(jnp.bfloat16),
    )
    state, history = train_steps(strategy, params, batches)
    assert float(history[-1]["compression_ratio"]) == pytest.approx(2.0, rel=0.05)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


def paths(params, fragments, order="depth"):
    """Each fragment's leaves, as ``/``-joined key paths."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    names = ["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p) for p, _ in flat]
    return [[names[i] for i in group] for group in fragment_indices(params, fragments, order)]


def test_fragments_are_contiguous_groups_of_about_equal_bytes():
    leaves = [jnp.zeros(10), jnp.zeros(1), jnp.zeros(1), jnp.zeros(10)]
    assert fragment_indices(leaves, 1) == ((0, 1, 2, 3),)
    assert fragment_indices(leaves, 2) == ((0, 1), (2, 3))
    assert fragment_indices(leaves, 3) == ((0,), (1, 2), (3,))
    assert fragment_indices(leaves, 4) == ((0,), (1,), (2,), (3,))
    mixed = [jnp.zeros(4, jnp.bfloat16), jnp.zeros(2, jnp.float32), jnp.zeros(8, jnp.float16)]
    assert fragment_indices(mixed, 2) == ((0, 1), (2,))  # 8 + 8 bytes, then 16
    with pytest.raises(ValueError, match="fragments must be at most the parameters' number of"):
        fragment_indices(leaves, 5)


def layered(count):
    """A transformer-like tree: embeddings, ``layers_0`` .. ``layers_{count-1}`` (kernel and
    bias each), a final norm; every block 8 floats."""
    layers = {f"layers_{i}": {"kernel": jnp.zeros(6), "bias": jnp.zeros(2)} for i in range(count)}
    return {"embed": jnp.zeros(8), **layers, "norm": {"scale": jnp.zeros(8)}}


def test_depth_fragments_follow_the_natural_order_of_the_key_paths():
    """layers_2 before layers_10 (the sorted key order jax flattens in puts layers_10 after
    layers_1)."""
    params = layered(12)
    layers = [f"layers_{i}/{k}" for i in range(12) for k in ("bias", "kernel")]
    assert paths(params, 1) == [["embed", *layers, "norm/scale"]]
    assert paths(params, 2) == [
        ["embed", *(f"layers_{i}/{k}" for i in range(6) for k in ("bias", "kernel"))],
        [*(f"layers_{i}/{k}" for i in range(6, 12) for k in ("bias", "kernel")), "norm/scale"],
    ]
    # A list's blocks are its items, also in natural (numeric) order.
    listed = {"layers": [{"w": jnp.zeros(4)} for _ in range(12)]}
    assert paths(listed, 3) == [[f"layers/{i}/w" for i in range(j, j + 4)] for j in (0, 4, 8)]


def test_strided_fragments_take_every_p_th_block():
    params = layered(4)  # blocks: embed, layers_0 .. layers_3, norm
    assert paths(params, 2, "strided") == [
        ["embed", "layers_1/bias", "layers_1/kernel", "layers_3/bias", "layers_3/kernel"],
        ["layers_0/bias", "layers_0/kernel", "layers_2/bias", "layers_2/kernel", "norm/scale"],
    ]
    blocks = ["embed", *(f"layers_{i}" for i in range(4)), "norm"]
    assert [{p.split("/")[0] for p in f} for f in paths(params, 6, "strided")] == [
        {b} for b in blocks
    ]  # one block each, kernel and bias together
    with pytest.raises(ValueError, match="number of blocks, 6, got 7"):
        fragment_indices(params, 7, "strided")


def test_an_explicit_list_names_each_fragment_s_blocks():
    params = layered(3)
    fragments = [["embed", "layers_2"], ["layers_0", "norm"], ["layers_1"]]
    assert paths(params, fragments) == [
        ["embed", "layers_2/bias", "layers_2/kernel"],
        ["layers_0/bias", "layers_0/kernel", "norm/scale"],
        ["layers_1/bias", "layers_1/kernel"],
    ]
    assert paths(
        params, [["layers_0/kernel", "layers_1"], ["layers_0/bias", "layers_2"], ["embed", "norm"]]
    ) == [
        ["layers_0/kernel", "layers_1/bias", "layers_1/kernel"],
        ["layers_0/bias", "layers_2/bias", "layers_2/kernel"],
        ["embed", "norm/scale"],
    ]
    with pytest.raises(ValueError, match="fragments leaves out .*norm/scale"):
        fragment_indices(params, [["embed", "layers_0", "layers_1", "layers_2"]])
    with pytest.raises(ValueError, match="fragments puts .*layers_0/bias.* in fragments 0 and 1"):
        fragment_indices(
            params, [["embed", "layers_0", "layers_1"], ["layers_0", "layers_2", "norm"]]
        )
    with pytest.raises(ValueError, match="fragments names 'layers_9', which matches no"):
        fragment_indices(
            params, [["embed", "layers_0", "layers_1", "layers_2", "norm", "layers_9"]]
        )
    with pytest.raises(ValueError, match="fragments must hold at least one fragment"):
        fragment_indices(params, [])
    with pytest.raises(ValueError, match="fragments' 1 is empty"):
        fragment_indices(params, [["embed", "layers_0", "layers_1", "layers_2", "norm"], []])


def test_strided_and_listed_fragments_train_as_the_same_list():
    """order="strided" is the explicit list of every P-th block, step for step; the
    default (depth) order differs on this tree."""
    n, params = 4, {f"w{i}": jnp.full((8, 8), 0.1 * i) for i in range(4)}
    batches = [
        {"x": np.random.default_rng(t).normal(size=(n, 8)).astype(np.float32)} for t in range(4)
    ]

    def run(**kwargs):
        strategy = ddl.streaming_diloco(
            toy_loss,
            optax.sgd(0.1),
            ddl.make_mesh(data=n),
            period=4,
            outer_optimizer=NESTEROV,
            **kwargs,
        )
        return train_steps(strategy, params, batches)[0].params

    strided = run(fragments=2, fragment_order="strided")
    chex.assert_trees_all_equal(strided, run(fragments=[["w0", "w2"], ["w1", "w3"]]))
    depth = run(fragments=2)
    chex.assert_trees_all_equal(depth, run(fragments=[["w0", "w1"], ["w2", "w3"]]))
    assert not np.allclose(depth["w1"], strided["w1"])


def test_init_refuses_more_fragments_than_blocks():
    strategy = ddl.streaming_diloco(
        toy_loss, optax.sgd(0.1), ddl.make_mesh(data=2), period=3, fragments=3
    )
    with pytest.raises(ValueError, match=r"fragments must be at most .* leaves, 2, got 3"):
        strategy.init({"a": jnp.zeros((2, 2)), "b": jnp.zeros((2, 2))})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"period": 0, "fragments": 1}, ValueError, "period must be an int >= 1"),
        ({"period": 4, "fragments": 0}, ValueError, "fragments must be an int >= 1"),
        ({"period": 6, "fragments": 4}, ValueError, "period must be a multiple of fragments"),
        ({"period": 4, "fragments": 2, "overlap": -1}, ValueError, "overlap must be an int >= 0"),
        ({"period": 4, "fragments": 2, "overlap": 2}, ValueError, r"overlap must be < .* = 2"),
        ({"period": 4, "fragments": 2, "mix": 1.5}, ValueError, "mix must be a finite real"),
        ({"period": 4, "fragments": 2, "mix": "half"}, ValueError, "mix must be"),
        (
            {"period": 4, "fragments": 2, "schedule": "torch"},
            ValueError,
            "schedule must be 'paper' or 'torchft'",
        ),
        (
            {"period": 4, "fragments": 2, "outer_optimizer": 0.7},
            TypeError,
            "outer_optimizer must be an optax",
        ),
        ({"period": 4, "fragments": 2, "reducer": "psum"}, TypeError, "reducer must be an optax"),
        ({"period": 4, "fragments": 2, "accumulate": 0}, ValueError, "accumulate must be"),
        (
            {"period": 4, "fragments": 2, "fragment_order": "random"},
            ValueError,
            "fragment_order must be 'depth' or 'strided'",
        ),
        (
            {"period": 4, "fragments": [["a"], ["b"]], "fragment_order": "strided"},
            ValueError,
            "fragment_order applies to a number of fragments",
        ),
        (
            {"period": 4, "fragments": [["a"], ["b"], ["c"]]},
            ValueError,
            "period must be a multiple",
        ),
        ({"period": 4, "fragments": "ab"}, ValueError, "fragments must be an int >= 1 or a list"),
        (
            {"period": 4, "fragments": [["a"], "b"]},
            ValueError,
            "fragments must be an int >= 1 or a list",
        ),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ddl.streaming_diloco(toy_loss, optax.sgd(0.1), ddl.make_mesh(data=2), **kwargs)
