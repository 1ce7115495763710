"""Eight simulated CPU devices before any JAX computation, and shared test fixtures."""

import ddl_jax as ddl

ddl.simulate_cpu_devices(8)

import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402


def mlp_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def mlp_pair() -> tuple:
    """``(loss_fn, params)`` of a small MLP, 12 -> 16 -> 5, the same on every call."""
    model = ddl.models.MLP(12, [16], 5, rngs=nnx.Rngs(0))
    return ddl.flax.loss_from_module(model, mlp_loss)


@pytest.fixture
def mlp():
    return mlp_pair()


def make_batches(count: int, size: int, seed: int = 0) -> list[dict]:
    """``count`` random classification batches for the MLP fixture."""
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(size, 12)).astype(np.float32),
            "y": rng.integers(0, 5, size=size).astype(np.int32),
        }
        for _ in range(count)
    ]


def reference_sgd(loss_fn, optimizer, params, batches):
    """Plain single-device training on each global batch: the obviously right answer."""
    params = jax.tree.map(jnp.array, params)
    opt_state = optimizer.init(params)
    for batch in batches:
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def worker_shards(batch, n: int) -> list[dict]:
    """The rows of a global batch that each of ``n`` workers sees, in worker order."""
    rows = len(jax.tree.leaves(batch)[0]) // n
    return [{k: v[i * rows : (i + 1) * rows] for k, v in batch.items()} for i in range(n)]


def replica_groups(line: str) -> set[frozenset[int]]:
    """The device groups of an HLO collective, in either of XLA's notations.

    ``replica_groups={{0,2},{1,3}}`` lists them; ``replica_groups=[2,2]<=[2,2]T(1,0)`` is
    ``iota(4).reshape(2, 2).transpose(1, 0).reshape(2, 2)``, one group per row.
    """
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
        dims = [int(d) for d in m[3].split(",")]
        ids = np.arange(np.prod(dims)).reshape(dims)
        if m[4]:
            ids = ids.transpose([int(p) for p in m[4].split(",")])
        return {frozenset(row) for row in ids.reshape(int(m[1]), int(m[2])).tolist()}
    groups = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)[1]
    return {frozenset(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", groups)}
