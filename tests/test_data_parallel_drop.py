"""Data parallelism with lost gradients (``ddl.data_parallel(drop=p)``), against a plain
loop written from torchft's ``Manager`` (github.com/pytorch/torchft, ``torchft/manager.py``):
a replica not participating zeroes its gradient, the all-reduce's sum is divided by the
participants, and a step without participants commits nothing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, train, train_steps, worker_shards

import ddl_jax as ddl


def torchft_reference(loss_fn, optimizer, params, batches, n, masks):
    """Every replica's step of a torchft loop: the participants' gradients summed over
    ``num_participants``, the optimizer stepped only where ``should_commit`` (one or more
    participants)."""
    opt_state = optimizer.init(params)
    for batch, mask in zip(batches, masks, strict=True):
        if not mask.any():
            continue
        shards = worker_shards(batch, n)
        grads = [jax.grad(loss_fn)(params, rows) for rows, m in zip(shards, mask, strict=True) if m]
        mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
        updates, opt_state = optimizer.update(mean, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize(("n", "drop", "steps"), [(2, 0.5, 10), (8, 0.3, 5)])
def test_lost_gradients_give_torchfts_participants_mean(mlp, n, drop, steps):
    loss_fn, params = mlp
    batches = make_batches(steps, 32)
    strategy = ddl.data_parallel(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=n), drop=drop)
    state, history = train_steps(strategy, params, batches)
    key = state.model.key
    masks = [np.asarray(ddl.consistency.arrivals(key, t, n, drop)) for t in range(steps)]
    counts = [int(m.sum()) for m in masks]
    assert any(0 < c < n for c in counts)  # a step losing some gradients, not all
    if n == 2:
        assert 0 in counts  # a step nothing arrived at: no commit
    assert [float(m["arrived"]) for m in history] == [c / n for c in counts]
    expected = torchft_reference(loss_fn, optax.adam(1e-2), params, batches, n, masks)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-6)
    # a lost gradient changes the run: the reliable one differs
    reliable = ddl.data_parallel(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=n))
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), strategy.params(state),
                         reliable.params(train(reliable, params, batches)[0]))  # fmt: skip
    assert max(jax.tree.leaves(moved)) > 1e-4


def _batch_mean(params, model_state, batch, key):
    """A loss whose model state is its batch's mean input: what the step averages."""
    del key
    loss = jnp.mean((batch["x"] @ params["w"]) ** 2)
    return loss, {"stats": {"mean": jnp.mean(batch["x"], axis=0)}}


def test_batch_statistics_are_the_mean_of_those_that_arrived():
    n, drop = 8, 0.4
    variables = {"params": {"w": jnp.ones(12)}, "stats": {"mean": jnp.zeros(12)}}
    strategy = ddl.data_parallel(
        ddl.ModelLoss(_batch_mean), optax.sgd(0.1), ddl.make_mesh(data=n), drop=drop
    )
    batch = make_batches(1, 32)[0]
    state = strategy.init(variables)
    mask = np.asarray(ddl.consistency.arrivals(state.model.key, 0, n, drop))
    assert 0 < mask.sum() < n
    state, _ = jax.jit(strategy.step)(state, batch)
    means = [rows["x"].mean(axis=0) for rows in worker_shards(batch, n)]
    expected = np.mean([m for m, here in zip(means, mask, strict=True) if here], axis=0)
    np.testing.assert_allclose(strategy.params(state)["stats"]["mean"], expected, rtol=1e-5)


def test_several_workers_a_device_are_the_run_of_as_many_devices(mlp):
    loss_fn, params = mlp
    batches = make_batches(4, 32)
    runs = [
        ddl.data_parallel(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=d), workers=8, drop=0.4)
        for d in (8, 4)
    ]
    (first, _), (second, _) = (train(s, params, batches) for s in runs)
    chex.assert_trees_all_close(runs[0].params(first), runs[1].params(second), atol=1e-6)


def test_a_stateless_mean_or_sparse_loco_leaves_the_lost_out_and_others_are_refused(mlp):
    loss_fn, params = mlp
    mesh, batches = ddl.make_mesh(data=8), make_batches(4, 32)
    plain = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, drop=0.4)
    cast = ddl.data_parallel(
        loss_fn, optax.sgd(0.1), mesh, drop=0.4, reducer=ddl.compression.cast(jnp.float32)
    )
    chex.assert_trees_all_close(
        plain.params(train(plain, params, batches)[0]),
        cast.params(train(cast, params, batches)[0]),
        atol=1e-6,
    )

    # told who arrived, SparseLoCo sending everything exactly (tiles of even sizes: an odd
    # one keeps an entry back) is the plain mean's run
    def linear(params, batch):
        logits = batch["x"] @ params["w"] + params["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    even = {"w": jnp.full((12, 6), 0.1), "b": jnp.zeros(6)}
    exact = ddl.compression.sparse_loco(1.0, decay=0.0, bits=None, clip_norm=False)
    plain, loco = (
        ddl.data_parallel(linear, optax.sgd(0.1), mesh, drop=0.4, reducer=reducer)
        for reducer in (None, exact)
    )
    chex.assert_trees_all_close(
        plain.params(train(plain, even, batches)[0]),
        loco.params(train(loco, even, batches)[0]),
        atol=1e-6,
    )
    with pytest.raises(ValueError, match="data_parallel: drop=0.4 leaves workers out"):
        ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, drop=0.4,
                          reducer=ddl.compression.top_k(0.5))  # fmt: skip
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="drop must be"):
            ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, drop=bad)


def test_drop_inside_islands_points_at_the_outer_method(mlp):
    loss_fn, _ = mlp
    mesh = ddl.make_mesh(island=2, data=4)
    with pytest.raises(ValueError, match=r"ddl.local_sgd\(inner=..., drop=p\)"):
        ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, drop=0.2)
