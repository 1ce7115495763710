"""Replica consistency: the consensus distance and the best replica, on known replicas."""

import jax.numpy as jnp
import numpy as np
import pytest

import ddl_jax as ddl


def test_consensus_distance_is_the_mean_distance_to_the_average():
    replicas = {
        "w": jnp.array([[0.0, 0.0], [2.0, 0.0], [1.0, 3.0], [1.0, -3.0]]),
        "b": jnp.ones((4,)),
    }
    # average (1, 0); distances 1, 1, 3, 3; b equal everywhere adds nothing
    assert ddl.consistency.consensus_distance(replicas) == pytest.approx(2.0)
    equal = {"w": jnp.full((8, 3), 0.1), "b": jnp.full((8,), 1 / 3)}
    assert ddl.consistency.consensus_distance(equal) == 0.0


def test_best_replica_by_score():
    replicas = {"w": jnp.array([[1.0], [5.0], [3.0], [5.0]])}
    index, replica = ddl.consistency.best_replica(replicas, lambda r: -abs(r["w"][0] - 4.5))
    assert index == 1
    np.testing.assert_array_equal(replica["w"], [5.0])


def test_a_diverged_replica_is_never_the_best():
    replicas = {"w": jnp.array([[1.0], [3.0], [jnp.nan]])}
    index, _ = ddl.consistency.best_replica(replicas, lambda r: -abs(r["w"][0] - 4.5))
    assert index == 1
    with pytest.raises(ValueError, match="every replica's score is nan"):
        ddl.consistency.best_replica({"w": jnp.full((2, 1), jnp.nan)}, lambda r: r["w"][0])


@pytest.mark.parametrize(
    "fn",
    [ddl.consistency.consensus_distance, lambda r: ddl.consistency.best_replica(r, len)],
)
def test_replicas_without_a_worker_axis_are_refused(fn):
    with pytest.raises(ValueError, match="leading worker axis"):
        fn({"w": jnp.zeros((4, 2)), "b": jnp.zeros((3,))})
    with pytest.raises(ValueError, match="at least one worker, got a worker axis of 0"):
        fn({"w": jnp.zeros((0, 2))})
