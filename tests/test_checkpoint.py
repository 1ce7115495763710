"""Checkpoints and resume in ``fit``: exact resume, corrupt steps, other models and meshes,
the non-finite step guard, and the variables read back without the strategy."""

import functools
import os
import re
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal_to_rounding, make_batches, mlp_loss
from flax import nnx

import ddl_jax as ddl
from ddl_jax._src.train import checkpoint
from ddl_jax._src.train.fit import fit

# One model and one strategy object per (name, workers) for the whole module, so that fit's
# jitted step compiles once per strategy rather than once per test.
LOSS_FN, PARAMS = ddl.flax.loss_from_module(ddl.models.MLP(12, [16], 5, rngs=nnx.Rngs(0)), mlp_loss)
BUILDERS = {
    "data_parallel": lambda mesh: ddl.data_parallel(LOSS_FN, optax.adam(1e-2), mesh),
    # lost gradients drawn from the run's key and step: a resumed run draws the same
    "data_parallel_drop": lambda mesh: ddl.data_parallel(LOSS_FN, optax.adam(1e-2), mesh, drop=0.4),
    "local_sgd": lambda mesh: ddl.local_sgd(LOSS_FN, optax.adam(1e-2), mesh, period=3),
}


@functools.cache
def strategy_for(name: str, workers: int = 8) -> ddl.Strategy:
    return BUILDERS[name](ddl.make_mesh(data=workers))


def train(strategy, batches, steps, directory=None, **kwargs):
    return fit(
        strategy, PARAMS, batches, steps=steps, checkpoint_dir=directory, progress=False, **kwargs
    )


def steps_in(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_resumed_fit_ends_bitwise_where_an_uninterrupted_one_does(name, tmp_path):
    strategy = strategy_for(name)
    batches = make_batches(6, 32)
    whole, _ = train(strategy, batches, 6)
    train(strategy, batches, 4, tmp_path, checkpoint_every=2)
    assert steps_in(tmp_path) == ["2", "4"]
    # A plain iterable is advanced past the 4 batches already trained on.
    state, history = train(strategy, batches, 6, tmp_path, checkpoint_every=2)
    assert [r["step"] for r in history] == [5, 6]
    chex.assert_trees_all_equal(state, whole)
    assert steps_in(tmp_path) == ["2", "4", "6"]
    # Nothing left to train: the checkpoint is the answer.
    again, history = train(strategy, batches, 6, tmp_path)
    assert history == []
    chex.assert_trees_all_equal(again, whole)


def test_a_save_cut_off_by_kill_9_is_cleaned_and_resume_takes_the_last_complete_one(tmp_path):
    strategy = strategy_for("data_parallel")
    batches = make_batches(6, 32)
    whole, _ = train(strategy, batches, 6)
    train(strategy, batches, 4, tmp_path, checkpoint_every=2)
    # what a process killed while writing step 6 leaves: orbax's temporary folder
    partial = tmp_path / "6.orbax-checkpoint-tmp-1764160000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "d").write_bytes(b"half")
    state, history = train(strategy, batches, 6, tmp_path, checkpoint_every=2)
    assert [r["step"] for r in history] == [5, 6]
    chex.assert_trees_all_equal(state, whole)
    assert steps_in(tmp_path) == ["2", "4", "6"]


def test_keep_bounds_the_steps_on_disk(tmp_path):
    train(
        strategy_for("data_parallel"), make_batches(5, 32), 5, tmp_path, checkpoint_every=1, keep=2
    )
    assert steps_in(tmp_path) == ["4", "5"]


def largest_data_file(step_dir, item="state") -> str:
    files = [
        os.path.join(root, f) for root, _, names in os.walk(step_dir / item / "d") for f in names
    ]
    return max(files, key=os.path.getsize)


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return path


def empty_manifest(step_dir):
    path = step_dir / "state" / "manifest.ocdbt"
    open(path, "w").close()
    return path


# orbax closes its event loop when the first read of a broken step fails, and tensorstore's
# reads still in flight then report "Event loop is closed" (one traceback each): the error
# filter fails the test if one of them gets through.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "damage",
    [
        lambda step_dir: truncate(largest_data_file(step_dir)),
        lambda step_dir: truncate(step_dir / "state" / "_METADATA"),
        empty_manifest,
    ],
)
def test_a_damaged_latest_step_is_reported_set_aside_and_the_previous_used(tmp_path, damage):
    strategy = strategy_for("local_sgd")
    batches = make_batches(4, 32)
    whole, _ = train(strategy, batches, 4)
    train(strategy, batches, 4, tmp_path, checkpoint_every=2)
    damaged = os.path.basename(damage(tmp_path / "4"))
    with pytest.warns(UserWarning, match=r"checkpoint step 4 in .* could not be restored") as got:
        state, history = train(strategy, batches, 4, tmp_path, checkpoint_every=2)
    (warning,) = [w for w in got if "could not be restored" in str(w.message)]
    # One line naming the step, the damaged file and what was done; it points at the
    # user's call (here train's call to fit), not into ddl_jax.
    message = str(warning.message)
    assert "\n" not in message and len(message) < 400 and "tensorstore_spec" not in message
    assert damaged in message and f"moved it to {tmp_path / 'corrupt-4'}" in message
    assert warning.filename == __file__
    assert [r["step"] for r in history] == [3, 4]  # resumed from step 2
    chex.assert_trees_all_equal(state, whole)
    assert steps_in(tmp_path) == ["2", "4", "corrupt-4"]  # the bad step is kept aside


def test_a_checkpoint_of_another_model_names_the_mismatching_leaf(tmp_path):
    train(strategy_for("data_parallel"), make_batches(2, 32), 2, tmp_path)
    other_loss, other = ddl.flax.loss_from_module(
        ddl.models.MLP(12, [17], 5, rngs=nnx.Rngs(0)), mlp_loss
    )
    strategy = ddl.data_parallel(other_loss, optax.adam(1e-2), ddl.make_mesh(data=8))
    with pytest.raises(ValueError, match=r"leaf 'params\.layers\.0\.bias' is float32\[16\] in"):
        fit(strategy, other, make_batches(2, 16), steps=3, checkpoint_dir=tmp_path)
    assert steps_in(tmp_path) == ["2"]  # a mismatch is not corruption: nothing is moved


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        (optax.adam(1e-2), optax.adamw(1e-2)),  # the same arrays, one more empty state
        (optax.sgd(0.1), optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1))),
    ],
)
def test_a_checkpoint_of_another_optimizer_chain_is_refused_and_left_in_place(
    tmp_path, saved, resumed
):
    mesh = ddl.make_mesh(data=8)
    train(ddl.data_parallel(LOSS_FN, saved, mesh), make_batches(2, 32), 2, tmp_path)
    with pytest.raises(ValueError, match=r"checkpoint step 2 in .* holds a state of another "):
        train(ddl.data_parallel(LOSS_FN, resumed, mesh), make_batches(3, 32), 3, tmp_path)
    assert steps_in(tmp_path) == ["2"]  # a mismatch is not corruption: nothing is moved


@pytest.mark.parametrize("damage", ["state item removed", "empty step folder"])
def test_a_step_without_its_state_beside_ones_with_it_is_set_aside(tmp_path, damage):
    """A copy cut short leaves a step folder without its state; fit's own folder holds
    steps with state, so that one is damaged, not an export: the previous step is used."""
    strategy = strategy_for("local_sgd")
    batches = make_batches(4, 32)
    whole, _ = train(strategy, batches, 4)
    train(strategy, batches, 2, tmp_path)
    if damage == "state item removed":
        train(strategy, batches, 4, tmp_path)
        shutil.rmtree(tmp_path / "4" / "state")
    else:
        (tmp_path / "4").mkdir()
    with pytest.warns(UserWarning, match=r"step 4 in .* could not be restored \(.*no 'state' item"):
        state, history = train(strategy, batches, 4, tmp_path)
    assert [r["step"] for r in history] == [3, 4]
    chex.assert_trees_all_equal(state, whole)
    assert "corrupt-4" in steps_in(tmp_path)


def test_replicated_state_restores_onto_another_mesh(tmp_path):
    saved, _ = train(strategy_for("data_parallel"), make_batches(2, 32), 2, tmp_path)
    mesh = ddl.make_mesh(data=4)
    like = BUILDERS["data_parallel"](mesh).init(PARAMS)
    with checkpoint.checkpoint_manager(tmp_path) as manager:
        restored, step = checkpoint.restore_latest(manager, like)
    assert step == 2
    chex.assert_trees_all_equal(jax.device_get(restored), jax.device_get(saved))
    for leaf in jax.tree.leaves(restored):
        assert leaf.sharding.mesh.shape == mesh.shape


def test_typed_prng_keys_and_counters_round_trip(tmp_path):
    mesh = ddl.make_mesh(data=8)
    state = jax.device_put(
        {"key": jax.random.split(jax.random.key(3), 8), "clock": np.arange(8, dtype=np.int32)},
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
    )
    with checkpoint.checkpoint_manager(tmp_path) as manager:
        checkpoint.save(manager, 1, state)
    with checkpoint.checkpoint_manager(tmp_path) as manager:
        restored, _ = checkpoint.restore_latest(manager, state)
    assert restored["key"].dtype == state["key"].dtype  # still a typed key array
    chex.assert_trees_all_equal(
        jax.random.key_data(restored["key"]), jax.random.key_data(state["key"])
    )
    chex.assert_trees_all_equal(restored["clock"], state["clock"])


def test_worker_local_state_refuses_another_worker_count(tmp_path):
    train(strategy_for("local_sgd"), make_batches(1, 32), 1, tmp_path)
    strategy = BUILDERS["local_sgd"](ddl.make_mesh(data=4))
    with pytest.raises(
        ValueError,
        match="is worker-local state for 8 workers, but the mesh has 4 workers on axis 'data'"
        ".* or the strategy's workers=8 where it takes one",
    ):
        train(strategy, make_batches(2, 32), 2, tmp_path)


def test_skip_nonfinite_skips_the_step_on_every_worker():
    strategy = strategy_for("local_sgd")
    clean = make_batches(5, 32)
    # Only worker 5's rows of batch 2 are NaN: its replica alone would go bad.
    batches = [dict(b) for b in clean]
    batches[2]["x"] = batches[2]["x"].copy()
    batches[2]["x"][20:24] = np.nan
    state, history = train(strategy, batches, 5, skip_nonfinite=True)
    assert [r["skipped"] for r in history] == [0.0, 0.0, 1.0, 0.0, 0.0]
    # As if batch 2 had never been there, step counter and synchronisation clock included
    # (period 3: the sync after the 3rd applied step is the 4th step's).
    expected, _ = train(strategy, clean[:2] + clean[3:], 4)
    assert_trees_equal_to_rounding(state, expected)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"checkpoint_every": 0}, "checkpoint_every must be an int >= 1, got 0"),
        ({"keep": 0}, "keep must be an int >= 1, got 0"),
        ({"checkpoint_dir": ""}, "checkpoint_dir must name a directory, got ''"),
    ],
)
def test_bad_checkpoint_arguments(tmp_path, kwargs, match):
    kwargs = {"directory": tmp_path} | {
        "directory" if k == "checkpoint_dir" else k: v for k, v in kwargs.items()
    }
    with pytest.raises(ValueError, match=match):
        train(strategy_for("data_parallel"), make_batches(2, 32), 2, **kwargs)


def test_a_cloud_directory_stays_a_url_and_a_local_one_becomes_absolute(monkeypatch):
    # A manager on gs:// would reach for GCS: record the directory orbax would be given.
    monkeypatch.setattr(checkpoint.ocp, "CheckpointManager", lambda directory, **_: directory)
    monkeypatch.setattr(checkpoint, "_check_writable", lambda directory: None)  # no ./run
    cloud = checkpoint.checkpoint_manager("gs://bucket/run")
    assert str(cloud) == "gs://bucket/run"
    assert str(cloud / f"{checkpoint.CORRUPT_PREFIX}4") == "gs://bucket/run/corrupt-4"
    assert str(checkpoint.checkpoint_manager("run")) == os.path.abspath("run")


class BNDropoutMLP(nnx.Module):
    def __init__(self, *, rngs):
        self.up = nnx.Linear(12, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.norm(self.up(x)))))


BN_LOSS, BN_VARIABLES = ddl.flax.loss_from_module(
    BNDropoutMLP(rngs=nnx.Rngs(params=0, dropout=1)), mlp_loss
)


@functools.cache
def bn_strategy() -> ddl.Strategy:
    return ddl.local_sgd(BN_LOSS, optax.adam(1e-2), ddl.make_mesh(data=8), period=3)


def test_a_model_with_batch_norm_and_dropout_resumes_bitwise_and_loads_without_a_strategy(
    tmp_path, capsys
):
    strategy = bn_strategy()
    batches = make_batches(6, 32)

    def run(steps, **kwargs):
        return fit(strategy, BN_VARIABLES, batches, steps=steps, progress=False, **kwargs)

    whole, _ = run(6)
    four, _ = run(4, checkpoint_dir=tmp_path, checkpoint_every=2)
    state, history = run(6, checkpoint_dir=tmp_path, checkpoint_every=2)
    assert "fit: resumed from step 4" in capsys.readouterr().out
    assert [r["step"] for r in history] == [5, 6]
    # Bitwise, dropout masks and batch statistics included.
    chex.assert_trees_all_equal(state, whole)
    assert sorted(os.listdir(tmp_path / "6")) == sorted(
        ["_CHECKPOINT_METADATA", "commit_success.txt", "state", "variables"]
    )

    # No strategy, no mesh: NumPy arrays on the host, the latest step by default.
    variables = ddl.checkpoint.load_variables(tmp_path)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(variables))
    trained = strategy.params(whole)
    chex.assert_trees_all_equal(variables, jax.device_get(trained))
    assert not np.allclose(variables["batch_stats"]["norm"]["mean"], 0.0)
    chex.assert_trees_all_equal(
        ddl.checkpoint.load_variables(tmp_path, step=np.int64(4)),
        jax.device_get(strategy.params(four)),
    )

    # Into a fresh module (other initial values) for inference.
    model = BNDropoutMLP(rngs=nnx.Rngs(params=7, dropout=8))
    ddl.flax.update_module(model, variables)
    model.eval()
    apply, _ = ddl.flax.split(model)
    x = make_batches(1, 8, seed=1)[0]["x"]
    np.testing.assert_allclose(model(x), apply(trained, x), rtol=1e-6)


# See the test above on orbax's closed-loop noise.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "target",
    [
        functools.partial(largest_data_file, item="variables"),
        lambda step_dir: step_dir / "variables" / "_METADATA",
    ],
)
def test_unreadable_latest_variables_fall_back_and_leave_the_state_usable(tmp_path, target):
    strategy = strategy_for("local_sgd")
    batches = make_batches(4, 32)
    two, _ = train(strategy, batches, 2)
    whole, _ = train(strategy, batches, 4, tmp_path, checkpoint_every=2)
    damaged = os.path.basename(truncate(target(tmp_path / "4")))
    with pytest.warns(UserWarning, match=r"checkpoint step 4 in .* could not be read") as got:
        variables = ddl.checkpoint.load_variables(tmp_path)
    (warning,) = [w for w in got if "could not be read" in str(w.message)]
    assert warning.filename == __file__
    assert damaged in str(warning.message) and "\n" not in str(warning.message)
    chex.assert_trees_all_equal(variables, jax.device_get(strategy.params(two)))
    assert steps_in(tmp_path) == ["2", "4"]  # loading changes nothing on disk
    with pytest.raises(ValueError, match="checkpoint step 4 in .* could not be read"):
        ddl.checkpoint.load_variables(tmp_path, step=4)
    # Resuming reads the state alone, which is intact.
    state, history = train(strategy, batches, 4, tmp_path)
    assert history == []
    chex.assert_trees_all_equal(state, whole)


def test_load_variables_names_the_directory_when_there_is_nothing_to_load(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=re.escape(f"{missing} does not exist")):
        ddl.checkpoint.load_variables(missing)
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path} holds no checkpoint step")):
        ddl.checkpoint.load_variables(tmp_path)
    train(strategy_for("data_parallel"), make_batches(2, 32), 2, tmp_path / "run")
    with pytest.raises(
        FileNotFoundError, match=r"holds no checkpoint step 3; it holds steps \[2\]"
    ):
        ddl.checkpoint.load_variables(tmp_path / "run", step=3)
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        ddl.checkpoint.load_variables(tmp_path / "run", step=-1)
    # A step saved without variables says so.
    with checkpoint.checkpoint_manager(tmp_path / "bare") as manager:
        checkpoint.save(manager, 1, {"w": jnp.ones(3)})
    with pytest.raises(ValueError, match="checkpoint step 1 in .* holds no 'variables' item"):
        ddl.checkpoint.load_variables(tmp_path / "bare")
    with pytest.raises(ValueError, match="is a file, not a checkpoint directory"):
        ddl.checkpoint.load_variables(__file__)


def test_a_newest_step_without_variables_falls_back_to_the_previous_one(tmp_path):
    """A save or a copy cut short left the newest step without its variables: the newest
    step that holds them is read, with a warning; asked for by number, it is an error."""
    strategy = strategy_for("data_parallel")
    batches = make_batches(4, 32)
    two, _ = train(strategy, batches, 2)
    train(strategy, batches, 4, tmp_path, checkpoint_every=2)
    shutil.rmtree(tmp_path / "4" / "variables")
    with pytest.warns(UserWarning, match=r"step 4 in .* holds no 'variables' item .a save or a"):
        variables = ddl.checkpoint.load_variables(tmp_path)
    chex.assert_trees_all_equal(variables, jax.device_get(strategy.params(two)))
    with pytest.raises(ValueError, match="checkpoint step 4 in .* holds no 'variables' item"):
        ddl.checkpoint.load_variables(tmp_path, step=4)


def test_export_writes_variables_that_load_without_a_strategy(tmp_path):
    variables = {**BN_VARIABLES, "params": jax.tree.map(np.asarray, BN_VARIABLES["params"])}
    ddl.checkpoint.export(tmp_path, variables)
    assert steps_in(tmp_path) == ["0"]
    chex.assert_trees_all_equal(ddl.checkpoint.load_variables(tmp_path), jax.device_get(variables))
    with pytest.raises(ValueError, match="already holds step 0"):
        ddl.checkpoint.export(tmp_path, variables)
    ddl.checkpoint.export(tmp_path, jax.tree.map(lambda x: x + 1, variables), step=1)
    chex.assert_trees_all_equal(
        ddl.checkpoint.load_variables(tmp_path, step=0), jax.device_get(variables)
    )
    # No strategy state in an export: fit says so rather than resuming from it.
    with pytest.raises(ValueError, match=r"checkpoint step 1 in .* holds no strategy state"):
        train(strategy_for("data_parallel"), make_batches(1, 32), 1, tmp_path)


def test_a_checkpoint_at_or_beyond_steps_trains_nothing_and_says_how_to_evaluate(tmp_path, capsys):
    strategy = strategy_for("data_parallel")
    saved, _ = train(strategy, make_batches(4, 32), 4, tmp_path)
    state, history = train(strategy, make_batches(3, 32), 3, tmp_path)
    assert history == []
    chex.assert_trees_all_equal(jax.device_get(state), jax.device_get(saved))
    assert "nothing left to train (no evaluation: eval_fn(strategy.params(state))" in (
        capsys.readouterr().out
    )
