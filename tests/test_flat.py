"""FlatView, pad_to / padded_size and map_fused against plain per-leaf arithmetic."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from jax.flatten_util import ravel_pytree

from ddl_jax._src.core.flat import FlatView, map_fused, pad_to, padded_size
from ddl_jax._src.reduce import wire


def mixed_tree(seed: int = 0) -> dict:
    """bf16, f32 and int32 leaves of several ranks, a scalar included: 22 entries."""
    rng = np.random.default_rng(seed)
    return {
        "a": jnp.asarray(rng.normal(size=(3, 4)), jnp.bfloat16),
        "b": [jnp.asarray(rng.normal(size=5), jnp.float32), jnp.float32(rng.normal())],
        "c": jnp.asarray(rng.integers(-100, 100, size=(2, 2)), jnp.int32),
    }


def assert_trees_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_of_records_structure_and_matches_a_shape_dtype_template():
    tree = mixed_tree()
    view = FlatView.of(tree)
    assert view.size == 22
    assert view.shapes == ((3, 4), (5,), (), (2, 2))
    assert view.dtypes == (jnp.bfloat16, jnp.float32, jnp.float32, jnp.int32)
    assert view.treedef == jax.tree.structure(tree)
    assert FlatView.of(jax.eval_shape(lambda: tree)) == view


@pytest.mark.parametrize("length", [None, 22, 31])
def test_ravel_unravel_round_trip_mixed_dtypes(length):
    tree = mixed_tree()
    view = FlatView.of(tree)
    flat = view.ravel(tree, length)
    assert flat.shape == (length or 22,) and flat.dtype == jnp.float32  # promoted
    np.testing.assert_array_equal(flat[:22], ravel_pytree(tree)[0])  # ravel_pytree's order
    np.testing.assert_array_equal(flat[22:], 0.0)
    assert_trees_equal(view.unravel(flat), tree)
    # Whatever sits in the padding is ignored.
    assert_trees_equal(view.unravel(flat.at[22:].set(7.0)), tree)


def test_ravel_casts_and_unravel_casts_back():
    tree = mixed_tree()
    view = FlatView.of(tree)
    flat = view.ravel(tree, 24, jnp.bfloat16)
    assert flat.dtype == jnp.bfloat16
    back = view.unravel(flat)
    assert [x.dtype for x in jax.tree.leaves(back)] == list(view.dtypes)
    # bf16 and the small ints survive bf16 exactly; the f32 leaves are rounded to bf16.
    want = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), tree)
    assert_trees_equal(back, want)


def test_ravel_and_unravel_under_jit():
    tree = mixed_tree()
    view = FlatView.of(jax.eval_shape(lambda: tree))
    out = jax.jit(lambda t: view.unravel(view.ravel(t, 40, jnp.float32)))(tree)
    assert_trees_equal(out, tree)


def test_empty_tree():
    view = FlatView.of({})
    assert view.size == 0
    flat = view.ravel({}, 3)
    assert flat.shape == (3,) and flat.dtype == jnp.float32
    assert view.unravel(flat) == {}
    assert view.blocks({}, 4).shape == (4, 0)


def test_bad_lengths_and_trees_are_refused():
    tree = mixed_tree()
    view = FlatView.of(tree)
    with pytest.raises(ValueError, match="length 21 < the tree's size 22"):
        view.ravel(tree, 21)
    with pytest.raises(ValueError, match="at least 22 entries"):
        view.unravel(jnp.zeros(21))
    with pytest.raises(ValueError, match="at least 22 entries"):
        view.unravel(jnp.zeros((2, 11)))
    with pytest.raises(ValueError, match="3 leaves, the view 4"):
        view.ravel({"a": tree["a"], "b": tree["b"][:1], "c": tree["c"]})
    with pytest.raises(ValueError, match="21 entries, not 22"):
        view.ravel({**tree, "c": tree["c"].ravel()[:3]})
    with pytest.raises(ValueError, match="n must be >= 1"):
        view.blocks(tree, 0)


@pytest.mark.parametrize("n", [1, 3, 7, 22, 25])
def test_blocks_and_from_blocks(n):
    tree = mixed_tree()
    view = FlatView.of(tree)
    blocks = view.blocks(tree, n)
    chunk = math.ceil(22 / n)
    assert blocks.shape == (n, chunk) and blocks.dtype == jnp.float32
    flat, _ = ravel_pytree(tree)
    np.testing.assert_array_equal(blocks, jnp.pad(flat, (0, n * chunk - 22)).reshape(n, chunk))
    assert_trees_equal(view.from_blocks(blocks), tree)
    assert view.blocks(tree, n, jnp.bfloat16).dtype == jnp.bfloat16


def test_pad_to_and_padded_size():
    x = jnp.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(pad_to(x, 4), [0, 1, 2, 3, 4, 5, 0, 0])
    np.testing.assert_array_equal(pad_to(x, 3), [0, 1, 2, 3, 4, 5])
    assert pad_to(x > 2, 8).dtype == bool and pad_to(x > 2, 8).shape == (8,)
    assert [padded_size(s, 4) for s in (0, 1, 4, 5, 8, 9)] == [0, 4, 4, 8, 8, 12]
    assert padded_size(22, 1) == 22


def test_map_fused_calls_fn_once_per_dtype_in_leaf_order():
    tree = mixed_tree()
    calls = []

    def fn(v):
        calls.append((v.dtype, v.shape))
        return jnp.cumsum(v, dtype=v.dtype)  # depends on the order of the entries

    out = map_fused(fn, tree)
    assert calls == [(jnp.bfloat16, (12,)), (jnp.float32, (6,)), (jnp.int32, (4,))]
    f32 = jnp.cumsum(jnp.concatenate([tree["b"][0], tree["b"][1][None]]))
    want = {
        "a": jnp.cumsum(tree["a"].ravel(), dtype=jnp.bfloat16).reshape(3, 4),
        "b": [f32[:5], f32[5]],
        "c": jnp.cumsum(tree["c"].ravel()).reshape(2, 2),
    }
    assert_trees_equal(out, want)


def test_map_fused_equals_fn_applied_leaf_wise():
    tree = {**mixed_tree(), "s": 3.0, "none": None}  # a Python scalar becomes an array
    out = map_fused(lambda v: v * 2 + 1, tree)
    want = jax.tree.map(lambda x: jnp.asarray(x) * 2 + 1, tree)
    assert_trees_equal(out, want)
    assert map_fused(lambda v: v + 1, {}) == {}


@settings(max_examples=10, deadline=None)
@given(
    hs.lists(
        hs.tuples(
            hs.lists(hs.integers(0, 4), max_size=3).map(tuple),
            hs.sampled_from([jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8]),
        ),
        max_size=5,
    ),
    hs.integers(1, 9),
)
def test_round_trips_for_any_shapes_and_dtypes(specs, n):
    rng = np.random.default_rng(len(specs))
    tree = [jnp.asarray(rng.integers(0, 50, size=s), d) for s, d in specs]
    view = FlatView.of(tree)
    assert view.size == sum(math.prod(s) for s, _ in specs)
    assert_trees_equal(view.unravel(view.ravel(tree, view.size + n)), tree)
    assert_trees_equal(view.from_blocks(view.blocks(tree, n)), tree)
    assert_trees_equal(map_fused(lambda v: v, tree), tree)


def test_unravel_updates_casts_each_leaf_back_to_its_dtype():
    """As the plain all-reduce returns updates: in the gradients' dtypes, one dtype or
    several (ravel_pytree's unravel kept float32 for a tree all of bfloat16), the padding
    past the tree's entries dropped."""
    bf16 = {"a": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.zeros(4, jnp.bfloat16)}
    mixed = {"a": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.zeros(4, jnp.float32)}
    for tree in (bf16, mixed):
        vector = jnp.linspace(-1.0, 1.0, 10, dtype=jnp.float32)
        _, unravel = ravel_pytree(jax.tree.map(lambda x: x.astype(jnp.float32), tree))
        want = jax.tree.map(lambda v, x: v.astype(x.dtype), unravel(vector), tree)
        padded = jnp.concatenate([vector, jnp.full(3, 9.0)])
        assert_trees_equal(wire.unravel_updates(FlatView.of(tree), padded), want)
