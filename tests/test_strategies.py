"""What every strategy promises; each new builder adds itself to STRATEGIES.

* it runs on a hand-built ``jax.sharding.Mesh`` (Auto axes), as every test here builds;
* its trivial case (one worker) is plain single-device training;
* the jitted step compiles once (also for the settings of LOSSY, whose trivial case is not
  plain SGD: a 1-bit or sparse gradient differs from the dense one even on one worker, and
  DES-LOC, Streaming DiLoCo's overlap and asynchronous local SGD's H > 1 are not SGD on one
  worker either);
* its state is a plain pytree that round-trips through an orbax checkpoint, and training
  resumed from the checkpoint continues exactly as if it had never stopped;
* ``params(state)`` compiles once, not on every call;
* a model with BatchNorm and Dropout (model state and randomness) trains under it: with one
  worker exactly as a hand-written Flax loop drawing the documented keys, its step compiles
  once, and a resumed run ends bitwise equal to an uninterrupted one, dropout masks included.
"""

import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import (
    BNDropoutMLP,
    bn_dropout_pair,
    first_stream_key,
    make_batches,
    mlp_pair,
    nnx_reference,
    reference_sgd,
)
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl


def one_stage_pipeline(schedule: str, microbatches: int):
    """The whole model as a pipeline's single stage, behind the (loss_fn, opt, mesh) signature:
    GPipe and 1F1B average M micro-batch gradients, DDG with M=1 steps on the whole batch. A
    ddl.ModelLoss (the BatchNorm and Dropout model) is a stateful stage of its variables."""

    def build(loss_fn, opt, mesh):
        _, template = bn_dropout_pair() if isinstance(loss_fn, ddl.ModelLoss) else mlp_pair()
        options = {"microbatches": microbatches, "schedule": schedule}
        strategy = ddl.pipeline([(loss_fn, template)], lambda loss, b: loss, opt, mesh, **options)
        return ddl.Strategy(
            init=lambda params: strategy.init([params]),
            step=strategy.step,
            params=lambda state: strategy.params(state)[0],
        )

    return build


def replicated_tensor_parallel(loss_fn, opt, mesh):
    """tensor_parallel with every parameter replicated over ``model`` (its trivial case)."""
    return ddl.tensor_parallel(loss_fn, opt, mesh, specs=P())


def islands_of(mesh: Mesh) -> Mesh:
    """``mesh``'s devices as islands of its ``data`` workers: two where they split evenly."""
    devices = mesh.devices.reshape(-1)
    islands = 2 if len(devices) % 2 == 0 else 1
    return Mesh(devices.reshape(islands, -1), ("island", "data"))


STRATEGIES = {
    "data_parallel": lambda loss_fn, opt, mesh: ddl.data_parallel(loss_fn, opt, mesh),
    "data_parallel_accumulate": lambda loss_fn, opt, mesh: ddl.data_parallel(
        loss_fn, opt, mesh, accumulate=2
    ),
    **{
        f"data_parallel_{algorithm}": lambda loss_fn, opt, mesh, a=algorithm: ddl.data_parallel(
            loss_fn, opt, mesh, reducer=ddl.allreduce_mean(algorithm=a)
        )
        for algorithm in ("ring", "tree", "ps")
    },
    "local_sgd": lambda loss_fn, opt, mesh: ddl.local_sgd(loss_fn, opt, mesh, period=2),
    # outer SGD at lr 1 is DiLoCo's trivial case; its Nesterov outer step is checked against
    # its definition in test_local_sgd.py.
    "local_sgd_diloco": lambda loss_fn, opt, mesh: ddl.local_sgd(
        loss_fn, opt, mesh, period=2, outer_optimizer=optax.sgd(1.0)
    ),
    # fragments in turn without overlap: one worker's fragment average is its own
    "streaming_diloco": lambda loss_fn, opt, mesh: ddl.streaming_diloco(
        loss_fn, opt, mesh, period=2, fragments=2
    ),
    # averaging the pair at outer lr 1 (the authors' default, 0.7 with momentum, is not)
    "noloco": lambda loss_fn, opt, mesh: ddl.noloco(
        loss_fn, opt, mesh, period=2, outer_optimizer=optax.sgd(1.0)
    ),
    "gossip_ring": lambda loss_fn, opt, mesh: ddl.gossip(loss_fn, opt, mesh, topology="ring"),
    # compression at its identity settings
    "data_parallel_cast_float32": lambda loss_fn, opt, mesh: ddl.data_parallel(
        loss_fn, opt, mesh, reducer=ddl.compression.cast(jnp.float32)
    ),
    "data_parallel_top_k_ratio_1": lambda loss_fn, opt, mesh: ddl.data_parallel(
        loss_fn, opt, mesh, reducer=ddl.compression.top_k(1.0)
    ),
    # rank 16 >= the smaller side of every kernel of the 12-16-5 MLP: exact, yet through the
    # low-rank exchange (min_compression_rate=0: no kernel falls back to a dense all-reduce)
    "data_parallel_power_sgd_full_rank": lambda loss_fn, opt, mesh: ddl.data_parallel(
        loss_fn,
        opt,
        mesh,
        reducer=ddl.compression.power_sgd(16, start_iter=0, min_compression_rate=0),
    ),
    # one worker's Adasum is its own gradient
    "data_parallel_adasum": lambda loss_fn, opt, mesh: ddl.data_parallel(
        loss_fn, opt, mesh, reducer=ddl.adasum()
    ),
    "local_sgd_top_k_ratio_1": lambda loss_fn, opt, mesh: ddl.local_sgd(
        loss_fn, opt, mesh, period=2, reducer=ddl.compression.top_k(1.0)
    ),
    "async_sgd_softsync": lambda loss_fn, opt, mesh: ddl.async_sgd(
        loss_fn,
        opt,
        mesh,
        compute_time=ddl.compute_times(1.0, spread=0.5, seed=0),
        protocol=ddl.softsync(min(2, mesh.shape["data"])),
    ),
    # Downpour's sharded server behind lr / tau scaling (tau = 0 with one worker)
    "async_sgd_downpour": lambda loss_fn, opt, mesh: ddl.async_sgd(
        loss_fn,
        optax.chain(ddl.scale_by_staleness(), opt),
        mesh,
        compute_time=[1.0] * (mesh.shape["data"] - 1) + [3.0],
        protocol=ddl.downpour(1, 1),
    ),
    # one inner step per push applied by outer SGD at lr 1: the inner optimizer's step
    "async_sgd_local": lambda loss_fn, opt, mesh: ddl.async_sgd(
        loss_fn, optax.sgd(1.0), mesh, protocol=ddl.async_local(1), inner_optimizer=opt
    ),
    "pipeline_gpipe": one_stage_pipeline("gpipe", 2),
    "pipeline_1f1b": one_stage_pipeline("1f1b", 2),
    "pipeline_ddg": one_stage_pipeline("ddg", 1),
    "tensor_parallel": replicated_tensor_parallel,
    # stage 3 (stages 1 and 2 keep the same kind of state, replicated params: test_fsdp.py)
    "fsdp": lambda loss_fn, opt, mesh: ddl.fsdp(loss_fn, opt, mesh, stage=3),
    # all of each chunk sent: the exact reduce-scatter, with error-feedback state
    "fsdp_scatter_top_k_ratio_1": lambda loss_fn, opt, mesh: ddl.fsdp(
        loss_fn, opt, mesh, reducer=ddl.compression.scatter_top_k(1.0)
    ),
    # islands: an outer method over a sharded inner strategy (averaging at outer lr 1)
    "local_sgd_over_fsdp": lambda loss_fn, opt, mesh: ddl.local_sgd(
        inner=ddl.fsdp(loss_fn, opt, islands_of(mesh), stage=3), period=2
    ),
    "diloco_over_data_parallel": lambda loss_fn, opt, mesh: ddl.local_sgd(
        inner=ddl.data_parallel(loss_fn, opt, islands_of(mesh)),
        period=2,
        outer_optimizer=optax.sgd(1.0),
    ),
    "noloco_over_fsdp": lambda loss_fn, opt, mesh: ddl.noloco(
        inner=ddl.fsdp(loss_fn, opt, islands_of(mesh), stage=1),
        period=2,
        outer_optimizer=optax.sgd(1.0),
    ),
    "streaming_diloco_over_tensor_parallel": lambda loss_fn, opt, mesh: ddl.streaming_diloco(
        inner=ddl.tensor_parallel(loss_fn, opt, islands_of(mesh), specs=P()),
        period=2,
        fragments=2,
    ),
    "gossip_over_fsdp": lambda loss_fn, opt, mesh: ddl.gossip(
        inner=ddl.fsdp(loss_fn, opt, islands_of(mesh), stage=2), topology="ring"
    ),
}
#: Stacked strategies build their own island mesh from the one they are given.
STACKED = (
    "gossip_over_fsdp",
    "local_sgd_over_fsdp",
    "diloco_over_data_parallel",
    "noloco_over_fsdp",
    "streaming_diloco_over_tensor_parallel",
)

LOSSY = {
    f"data_parallel_{name}": lambda loss_fn, opt, mesh, r=reducer: ddl.data_parallel(
        loss_fn, opt, mesh, reducer=r()
    )
    for name, reducer in {
        "sign": lambda: ddl.compression.sign(),
        "qsgd": lambda: ddl.compression.qsgd(4),
        "threshold": lambda: ddl.compression.threshold(0.01),
        "top_k_dgc": lambda: ddl.compression.top_k(
            0.1, momentum=0.9, clip_norm=1.0, warmup_steps=4
        ),
        "demo": lambda: ddl.compression.demo(0.25, chunk=8),
    }.items()
} | {
    # SparseLoCo's 2-bit outer gradients; DES-LOC's Adam moments (no such field in SGD's
    # state); Streaming DiLoCo's overlapped outer step mixed into a moved replica
    "local_sgd_sparse_loco": lambda loss_fn, opt, mesh: ddl.local_sgd(
        loss_fn, opt, mesh, period=2, reducer=ddl.compression.sparse_loco(0.25, chunk=16)
    ),
    "local_sgd_desloc_unreliable": lambda loss_fn, opt, mesh: ddl.local_sgd(
        loss_fn, opt, mesh, period=2, state_periods={"mu": 2, "nu": 4}, drop=0.3, churn=0.2
    ),
    "desloc_sparse_loco_over_fsdp": lambda loss_fn, opt, mesh: ddl.local_sgd(
        inner=ddl.fsdp(loss_fn, opt, islands_of(mesh), stage=3),
        period=2,
        state_periods={"mu": 2, "nu": 4},
        reducer=ddl.compression.sparse_loco(0.25, chunk=16, axis="island"),
    ),
    "streaming_diloco_overlap_mix": lambda loss_fn, opt, mesh: ddl.streaming_diloco(
        loss_fn, opt, mesh, period=4, fragments=2, overlap=1, mix=0.5
    ),
    # 0/1 Adam is its own optimizer (opt unused): two steps updating the variance, then
    # local steps, synchronised at the third step (1-bit residuals in the checkpoint) and
    # every second step after
    "zero_one_adam": lambda loss_fn, opt, mesh: ddl.zero_one_adam(
        loss_fn, 1e-2, mesh, var_freeze_step=2, local_step_scaler=1, local_step_clipper=2
    ),
    # two inner steps per push, the server's delayed Nesterov over the workers' arrivals
    "async_sgd_local_delayed_nesterov": lambda loss_fn, opt, mesh: ddl.async_sgd(
        loss_fn,
        ddl.delayed_nesterov(0.7, 0.9, delay=mesh.shape["data"]),
        mesh,
        protocol=ddl.async_local(2),
        inner_optimizer=opt,
        drop=0.2,
    ),
}
EVERY = {**STRATEGIES, **LOSSY}


def run(step, state, batches):
    for batch in batches:
        state, _ = step(state, batch)
    return state


def auto_mesh(n: int) -> Mesh:
    """A mesh built by hand, as users do: its axes are Auto, not ``ddl.make_mesh``'s Explicit."""
    return Mesh(np.array(jax.devices()[:n]), ("data",))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_one_worker_is_single_device_sgd(mlp, name):
    loss_fn, params = mlp
    batches = make_batches(4, 16)
    strategy = STRATEGIES[name](loss_fn, optax.sgd(0.1), auto_mesh(1))
    state = run(jax.jit(strategy.step), strategy.init(params), batches)
    expected = reference_sgd(loss_fn, optax.sgd(0.1), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)


def train_save_resume(strategy, variables, directory):
    """Three steps, an orbax checkpoint, three more from the restored state and from the
    original: asserts they end bitwise equal and that the step compiled once. Returns the
    state at the checkpoint, the restored one and the final one."""
    batches = make_batches(6, 32)
    traces = []

    def counted(state, batch):
        traces.append(1)
        return strategy.step(state, batch)

    step = jax.jit(counted)
    state = run(step, strategy.init(variables), batches[:3])
    with ocp.CheckpointManager(directory) as manager:
        manager.save(3, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        like = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = manager.restore(3, args=ocp.args.StandardRestore(like))
    final = run(step, state, batches[3:])
    chex.assert_trees_all_equal(run(step, restored, batches[3:]), final)
    assert len(traces) == 1
    return state, restored, final


# A pipeline's stage is the model loss; with one micro-batch its forward sees the whole batch.
WITH_MODEL_STATE = {
    **STRATEGIES,
    "pipeline_gpipe_one_micro_batch": one_stage_pipeline("gpipe", 1),
    "pipeline_1f1b_one_micro_batch": one_stage_pipeline("1f1b", 1),
}


# Accumulation (and a pipeline's M micro-batches) normalises each micro-batch by its own
# statistics and updates them once per micro-batch, as k smaller steps' forward passes
# would: not one pass over the whole batch.
MICRO_BATCHED = ("data_parallel_accumulate", "pipeline_gpipe", "pipeline_1f1b")
WHOLE_BATCH = sorted(k for k in WITH_MODEL_STATE if k not in MICRO_BATCHED)


@pytest.mark.parametrize("name", WHOLE_BATCH)
def test_one_worker_with_batch_norm_and_dropout_is_a_flax_training_loop(name):
    loss_fn, variables = bn_dropout_pair()
    batches = make_batches(4, 16)
    strategy = WITH_MODEL_STATE[name](loss_fn, optax.sgd(0.1), auto_mesh(1))
    state = run(jax.jit(strategy.step), strategy.init(variables), batches)
    reference = BNDropoutMLP(rngs=nnx.Rngs(params=0, dropout=1))
    expected = nnx_reference(reference, optax.sgd(0.1), batches, first_stream_key(reference))
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)


RESUMABLE = EVERY | WITH_MODEL_STATE


@pytest.mark.parametrize("name", sorted(RESUMABLE))
def test_compiles_once_and_resumes_bitwise_from_a_checkpoint(name, tmp_path, caplog):
    """With batch norm and dropout: the model state and the keys resume with the rest."""
    loss_fn, variables = bn_dropout_pair()
    strategy = RESUMABLE[name](loss_fn, optax.adam(1e-2), auto_mesh(8))
    state, restored, final = train_save_resume(strategy, variables, tmp_path)
    chex.assert_trees_all_equal(restored, state)
    assert all(
        a.sharding.is_equivalent_to(b.sharding, a.ndim)
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True)
    )
    trained = strategy.params(final)  # compiles here, once: not again on later calls
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        again = [strategy.params(final) for _ in range(2)]
    assert not [r for r in caplog.records if "Compiling" in r.getMessage()]
    chex.assert_trees_all_equal(again[-1], trained)
    kernel = variables["params"]["up"]["kernel"]
    assert not np.allclose(trained["params"]["up"]["kernel"], kernel)
    assert not np.allclose(trained["batch_stats"]["norm"]["mean"], 0.0)


@pytest.mark.parametrize("name", sorted(n for n in STRATEGIES if n not in STACKED))
def test_a_mesh_axis_the_strategy_does_not_use_is_refused(mlp, name):
    loss_fn, _ = mlp
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "extra"))
    with pytest.raises(ValueError, match=r"axis .extra. \(size 4\).*it uses \[") as error:
        STRATEGIES[name](loss_fn, optax.sgd(0.1), mesh)
    assert "'data'" in str(error.value)
    # A size-1 axis it does not use holds no copies: accepted.
    one = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "extra"))
    STRATEGIES[name](loss_fn, optax.sgd(0.1), one)


@pytest.mark.parametrize("name", sorted(n for n in STRATEGIES if not n.startswith("pipeline")))
def test_a_module_loss_passed_as_loss_fn_points_to_loss_from_module(mlp, name):
    """``loss(model, batch)`` given where ``loss_fn(params, batch)`` belongs: the first
    argument (the params) gets called, and the error says what to do."""
    from conftest import mlp_loss

    _, params = mlp
    strategy = STRATEGIES[name](mlp_loss, optax.sgd(0.1), auto_mesh(2))
    state = strategy.init(params)
    with pytest.raises(TypeError, match=r"ddl\.flax\.loss_from_module"):
        jax.eval_shape(strategy.step, state, make_batches(1, 8)[0])  # tracing is enough
