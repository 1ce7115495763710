"""Eight simulated CPU devices before any JAX computation, and shared test fixtures."""

import os
import pathlib
import shutil

# Most of the suite's time is XLA compiling small programs. LLVM's optimisation of their
# machine code costs more than running it, and leaves the optimised HLO, which the tests
# read, as it is. Compiled programs are kept on disk, shared by the test processes and by
# the processes the tests launch (given ``COMPILE_ENV``). JAX's size bound on the
# cache takes a file lock on every read, which costs more than it saves, so the cache is
# emptied here instead, by the first process of a run, once it passes 1 GiB. XLA:CPU's
# fusion emitters (its default) compile a step in about twice the time of the elemental
# emitters they replace: the clean-clone suite took 571 s with the elemental ones against
# 964 s. Those round some fused sums in another order from one program to another, so the
# two tests comparing different programs that compute the same values compare to that
# rounding (``assert_trees_equal_to_rounding``); every other bitwise test holds as it is.
_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax"
_FIRST_PROCESS = "PYTEST_XDIST_WORKER" not in os.environ
if _FIRST_PROCESS and _CACHE.is_dir() and sum(f.stat().st_size for f in _CACHE.iterdir()) > 2**30:
    shutil.rmtree(_CACHE, ignore_errors=True)
COMPILE_ENV = {
    "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
    "JAX_COMPILATION_CACHE_DIR": str(_CACHE),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
_USER_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
os.environ.update(COMPILE_ENV, XLA_FLAGS=f"{_USER_XLA_FLAGS} {COMPILE_ENV['XLA_FLAGS']}")

import ddl_jax as ddl  # noqa: E402

ddl.simulate_cpu_devices(8)


import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from ddl_jax._src.measure import comm  # noqa: E402
from ddl_jax._src.reduce import allreduce as reducers  # noqa: E402

#: The tail of a child process's script: gloo's transport loop threads found over a
#: second, printed as "gloo loop threads N all at SCHED_IDLE True|False".
GLOO_LOOPS_REPORT = """
import os, time
from ddl_jax._src.xla_cpu import gloo_threads
time.sleep(1.0)  # the watcher looks twice a second
loops = set()
for _ in range(100):  # a loop thread spends moments outside epoll_wait
    loops |= set(gloo_threads.loop_threads())
    time.sleep(0.01)
idle = [os.sched_getscheduler(t) == os.SCHED_IDLE for t in loops]
print("gloo loop threads", len(loops), "all at SCHED_IDLE", all(idle))
"""


def child_env() -> dict[str, str]:
    """The environment of a process a test launches: CPU, the compile settings above, and
    none of this process's JAX / XLA / launcher variables (its 8 simulated devices)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "DDL_JAX"))}
    return {**env, "JAX_PLATFORMS": "cpu", **COMPILE_ENV}


def assert_trees_equal_to_rounding(actual, desired, eps: int = 4) -> None:
    """Two pytrees of one structure: floating leaves within ``eps`` machine epsilons of
    the leaf's largest entry (a sum rounded in another order; see the compile settings
    above), the others equal."""
    chex.assert_trees_all_equal_structs(actual, desired)
    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired), strict=True):
        a, d = np.asarray(a), np.asarray(d)
        if np.issubdtype(a.dtype, np.floating):
            scale = np.abs(d).max(initial=0.0)
            np.testing.assert_allclose(a, d, rtol=0, atol=eps * np.finfo(d.dtype).eps * scale)
        else:
            np.testing.assert_array_equal(a, d)


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


@pytest.fixture
def cluster_buckets(monkeypatch):
    """``bucket_mb="auto"`` as on a CPU cluster (25 MiB buckets): one process here, where
    "auto" goes leaf by leaf."""
    monkeypatch.setattr(reducers, "default_bucket_bytes", lambda: int(reducers.BUCKET_MB * 2**20))


class BNDropoutMLP(nnx.Module):
    def __init__(self, *, rate=0.3, axis_name=None, rngs):
        self.up = nnx.Linear(12, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, axis_name=axis_name, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.out = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.norm(self.up(x)))))


def nnx_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def step_key(base, step, worker=0):
    key = jax.random.wrap_key_data(base, impl="threefry2x32")
    return jax.random.fold_in(jax.random.fold_in(key, step), worker)


def nnx_reference(model, optimizer, batches, base):
    """Single-device NNX training, reseeding each stream i with fold_in(step key, i)."""
    graphdef, params, stats, keys, counts = nnx.split(
        model, nnx.Param, nnx.BatchStat, nnx.RngKey, nnx.RngCount
    )
    params, stats = nnx.to_pure_dict(params), nnx.to_pure_dict(stats)
    keys, counts = nnx.to_pure_dict(keys), nnx.to_pure_dict(counts)
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(params, stats, opt_state, batch, key):
        leaves, treedef = jax.tree.flatten(keys)
        fresh = treedef.unflatten([jax.random.fold_in(key, i) for i in range(len(leaves))])

        def loss(p):
            m = nnx.merge(graphdef, p, stats, fresh, counts)
            return nnx_loss(m, batch), nnx.to_pure_dict(nnx.state(m, nnx.BatchStat))

        grads, stats = jax.grad(loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state

    for t, batch in enumerate(batches):
        params, stats, opt_state = train_step(params, stats, opt_state, batch, step_key(base, t))
    return {"params": params, "batch_stats": stats}


def first_stream_key(model):
    return jax.random.key_data(jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.RngKey)))[0])


def bn_dropout_pair() -> tuple:
    """``(loss_fn, variables)`` of an MLP with BatchNorm and Dropout, the same on every call."""
    return ddl.flax.loss_from_module(BNDropoutMLP(rngs=nnx.Rngs(params=0, dropout=1)), nnx_loss)


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


def train(strategy, params, batches):
    """``strategy`` from ``params`` over ``batches`` (jitted, state donated):
    ``(state, last metrics)``."""
    step = jax.jit(strategy.step, donate_argnums=0)
    state = strategy.init(params)
    for batch in batches:
        state, metrics = step(state, batch)
    return state, metrics


def train_steps(strategy, params, batches):
    """As :func:`train`, with every step's metrics: ``(state, [metrics, ...])``."""
    step = jax.jit(strategy.step, donate_argnums=0)
    state, history = strategy.init(params), []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    return state, history


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
    """The device groups of an HLO collective (``comm.replica_groups``), as sets."""
    return {frozenset(group) for group in comm.replica_groups(line, 0)}
