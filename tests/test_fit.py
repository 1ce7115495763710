"""The training loop."""

import gc
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, mlp_pair, reference_sgd

import ddl_jax as ddl
from ddl_jax._src.train import log as fit_log


def test_fit_trains_like_the_reference_and_records_every_step(mlp):
    loss_fn, params = mlp
    batches = make_batches(7, 32)
    strategy = ddl.data_parallel(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=8))
    state, history = ddl.fit(
        strategy, params, batches, steps=np.int64(7), log_every=np.int32(3), progress=False
    )
    expected = reference_sgd(loss_fn, optax.adam(1e-2), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)
    assert [r["step"] for r in history] == list(range(1, 8))
    np.testing.assert_allclose(history[0]["loss"], loss_fn(params, batches[0]), rtol=1e-6)


def test_fit_leaves_the_callers_params_usable(mlp):
    loss_fn, params = mlp
    before = jax.tree.map(np.asarray, params)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=1))
    ddl.fit(strategy, params, make_batches(2, 8), steps=2, progress=False)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, params), before)  # not donated


def test_eval_runs_every_eval_every_steps_and_at_the_end(mlp):
    loss_fn, params = mlp
    seen = []

    def eval_fn(p):
        seen.append(1)
        return {"loss0": loss_fn(p, make_batches(1, 8)[0])}

    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    state, history = ddl.fit(
        strategy,
        params,
        make_batches(5, 8),
        steps=5,
        eval_fn=eval_fn,
        eval_every=2,
        progress=False,
    )
    assert [r["step"] for r in history if "eval_loss0" in r] == [2, 4, 5]
    assert len(seen) == 3
    np.testing.assert_allclose(
        history[-1]["eval_loss0"],
        loss_fn(strategy.params(state), make_batches(1, 8)[0]),
        rtol=1e-6,
    )


def test_nan_loss_stops_training_naming_the_step(mlp):
    loss_fn, params = mlp
    batches = make_batches(4, 8)
    batches[2]["x"][0, 0] = np.nan
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    with pytest.raises(FloatingPointError, match="loss is nan at step 3"):
        ddl.fit(strategy, params, batches, steps=4, log_every=10, progress=False)


def test_running_out_of_batches_warns_and_still_evaluates(mlp):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    with pytest.warns(UserWarning, match="ran out after 2 of 5 steps"):
        _, history = ddl.fit(
            strategy, params, make_batches(2, 8), steps=5, eval_fn=lambda p: 1.0, progress=False
        )
    assert len(history) == 2 and history[-1]["eval"] == 1.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"steps": 0}, ValueError, "steps must be an int >= 1, got 0"),
        ({"log_every": 2.5}, ValueError, "log_every must be an int >= 1, got 2.5"),
        ({"strategy": (1, 2, 3)}, TypeError, "strategy must be a ddl.Strategy"),
        ({"batches": []}, ValueError, "batches yielded no batch"),
        ({"batches": {"x": np.zeros((8, 12))}}, TypeError, "got dict .a dataset. ddl.data.batch"),
        ({"batches": 3}, TypeError, "batches must be an iterable of global batches, or start"),
        # Settings that would otherwise be silently ignored.
        (
            {"checkpoint_every": 1},
            ValueError,
            "checkpoint_every=1 needs checkpoint_dir, got checkpoint_dir=None",
        ),
        ({"keep": 2}, ValueError, "keep=2 needs checkpoint_dir, got checkpoint_dir=None"),
        ({"eval_every": 1}, ValueError, "eval_every=1 needs eval_fn, got eval_fn=None"),
        ({"skip_nonfinite": "no"}, TypeError, "skip_nonfinite must be a bool, got 'no'"),
        ({"progress": 1}, TypeError, "progress must be a bool, got 1"),
        ({"eval_every": np.int64(0), "eval_fn": len}, ValueError, "eval_every must be an int >= 1"),
        (
            {"log_file": 3},
            TypeError,
            "log_file must be a str or os.PathLike path, or None, got int",
        ),
        ({"log_file": b"log"}, TypeError, "log_file must be a str or os.PathLike path"),
        ({"log_file": ""}, ValueError, "log_file must name a file, got ''."),
        ({"log_file": "."}, ValueError, "log_file must name a file, got '.' .a directory."),
        ({"tensorboard_dir": 3}, TypeError, "tensorboard_dir must be a str or os.PathLike path"),
        ({"tensorboard_dir": ""}, ValueError, "tensorboard_dir must name a directory, got ''."),
        ({"tensorboard_dir": __file__}, ValueError, "directory, got .*test_fit.py. .a file..$"),
        ({"callbacks": print}, TypeError, "callbacks must be a sequence of callables"),
        ({"callbacks": None}, TypeError, "callbacks must be a sequence of callables"),
        ({"callbacks": [print, 3]}, TypeError, "callbacks.1. must be callable, got 3"),
        ({"keep": 0}, ValueError, "^fit: keep must be an int >= 1, got 0.$"),
        ({"checkpoint_dir": 3}, TypeError, "checkpoint_dir must be a str or os.PathLike path"),
    ],
)
def test_bad_arguments(mlp, kwargs, error, match):
    loss_fn, params = mlp
    args = {
        "strategy": ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2)),
        "params": params,
        "batches": make_batches(2, 8),
        "steps": 2,
        "progress": False,
    }
    with pytest.raises(error, match=match):
        ddl.fit(**{**args, **kwargs})


def sgd_run(capsys, **kwargs):
    loss_fn, params = mlp_pair()
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    args = {"steps": 4, "log_every": 2, "eval_fn": lambda p: 1.0, "eval_every": 4, **kwargs}
    ddl.fit(strategy, params, make_batches(4, 8), **args)
    return capsys.readouterr()


def test_progress_false_prints_nothing_evaluations_included(capsys):
    captured = sgd_run(capsys, progress=False)
    assert captured.out == "" and captured.err == ""


def test_without_a_terminal_progress_is_plain_lines_from_process_0(capsys):
    # Under pytest (as under a launcher, or redirected to a file) stdout is no terminal.
    captured = sgd_run(capsys)
    lines = captured.out.splitlines()
    assert len(lines) == 3, lines
    for line, step in zip(lines[:2], (2, 4), strict=True):
        assert re.fullmatch(rf"step {step}/4: loss=\d+\.\d{{4}}, ex_per_s=\d+", line), line
    assert lines[2] == "step 4: eval=1.0000"
    assert "\r" not in captured.out + captured.err


def test_on_a_terminal_progress_is_a_bar(capsys, monkeypatch):
    monkeypatch.setattr(fit_log, "_interactive", lambda: True)
    captured = sgd_run(capsys)
    assert "\r" in captured.out and "4/4" in captured.out
    assert "step 2/4:" not in captured.out
    assert "step 4: eval=1.0000" in captured.out.splitlines()


def test_a_growing_loss_warns_once_naming_the_learning_rate():
    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - 1.0) ** 2)

    params = {"w": np.zeros(12, np.float32)}
    # A negative learning rate ascends: the loss grows about 4x a step.
    strategy = ddl.data_parallel(loss_fn, optax.sgd(-0.5), ddl.make_mesh(data=2))
    with pytest.warns(ddl.LossGrowthWarning, match="the loss grew from") as got:
        _, history = ddl.fit(
            strategy, params, make_batches(20, 8), steps=20, log_every=5, progress=False
        )
    growth = [w for w in got if issubclass(w.category, ddl.LossGrowthWarning)]
    assert len(growth) == 1 and growth[0].filename == __file__  # once, at the user's line
    message = str(growth[0].message)
    assert "learning rate is likely too high, or negative" in message
    assert history[-1]["loss"] > 1e4 * history[0]["loss"]


def test_a_loss_that_falls_or_grows_less_than_100x_does_not_warn(mlp):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=2))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        ddl.fit(strategy, params, make_batches(5, 8), steps=5, log_every=1, progress=False)
    assert not [w for w in got if "loss grew" in str(w.message)]
    first = {"step": 1, "loss": 2.0}
    assert fit_log._growth_warning(first, [{"step": 2, "loss": 150.0}]) is None  # 75x
    message = fit_log._growth_warning(first, [{"step": 3, "loss": 201.0}])
    assert "from 2 at step 1 to 201 at step 3" in message
    # A negative loss (a log-likelihood) that keeps falling is not growth.
    first = {"step": 1, "loss": -0.5}
    assert fit_log._growth_warning(first, [{"step": 2, "loss": -90.0}]) is None


def read_log(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_log_file_and_callbacks_get_every_record_in_order_evals_merged(mlp, tmp_path):
    loss_fn, params = mlp
    seen, path = [], tmp_path / "new" / "log.jsonl"  # parents created
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    _, history = ddl.fit(
        strategy,
        params,
        make_batches(5, 8),
        steps=5,
        log_every=2,
        eval_fn=lambda p: {"one": 1.0},
        eval_every=3,
        progress=False,
        log_file=path,
        callbacks=[seen.append, lambda record: record.clear()],  # each gets its own copy
    )
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in history if "eval_one" in r] == [3, 5]
    assert read_log(path) == history and seen == history


def test_a_resumed_run_logs_each_step_once(tmp_path):
    loss_fn, params = mlp_pair()
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    batches, path, ckpt = make_batches(6, 8), str(tmp_path / "log.jsonl"), tmp_path / "ckpt"
    tb = tmp_path / "tb"
    args = {"checkpoint_dir": ckpt, "log_every": 3, "progress": False, "log_file": path}
    args |= {"tensorboard_dir": tb}

    def tensorboard_shows_the_log():
        return read_scalars(tb)["loss"] == {r["step"]: r["loss"] for r in read_log(path)}

    _, first = ddl.fit(strategy, params, batches, steps=4, checkpoint_every=2, **args)
    assert read_log(path) == first and tensorboard_shows_the_log()
    # A crash after step 4's records were written, before its checkpoint was complete, and
    # in the middle of a later write: the run resumes at step 2, as if 3 and 4 never ran.
    shutil.rmtree(ckpt / "4")
    with open(path, "a") as f:
        f.write('{"step": 5, "lo')
    _, second = ddl.fit(strategy, params, batches, steps=6, **args)
    assert [r["step"] for r in second] == [3, 4, 5, 6]
    assert read_log(path) == first[:2] + second and tensorboard_shows_the_log()
    # A run that does not resume (no checkpoint) starts the file afresh.
    _, third = ddl.fit(
        strategy, params, batches, steps=2, log_file=path, tensorboard_dir=tb, progress=False
    )
    assert read_log(path) == third and tensorboard_shows_the_log()
    assert len(list(tb.glob("events.out.tfevents.*"))) == 3


def test_a_file_that_is_not_a_log_is_refused_and_left_alone(mlp, tmp_path):
    loss_fn, params = mlp
    path = tmp_path / "data.csv"
    path.write_text("x,y\n1,2\n")
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    with pytest.raises(ValueError, match="data.csv' is not a log of fit: line 1 is not a JSON"):
        ddl.fit(strategy, params, make_batches(2, 8), steps=2, log_file=path, progress=False)
    assert path.read_text() == "x,y\n1,2\n"


def test_a_callback_stops_training_and_the_run_resumes_from_its_checkpoint(tmp_path):
    loss_fn, params = mlp_pair()
    strategy = ddl.data_parallel(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=2))
    batches = make_batches(6, 8)
    whole, _ = ddl.fit(strategy, params, batches, steps=6, progress=False)
    path = tmp_path / "log.jsonl"
    args = {"checkpoint_dir": tmp_path / "ckpt", "progress": False, "log_file": path}
    evals = []
    _, history = ddl.fit(
        strategy,
        params,
        batches,
        steps=6,
        log_every=1,
        eval_fn=lambda p: evals.append(1) or 0.5,
        callbacks=[lambda record: record["step"] == 3],
        **args,
    )
    assert [r["step"] for r in history] == [1, 2, 3]
    assert evals == [] and read_log(path) == history  # no final evaluation
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["3"]
    state, rest = ddl.fit(strategy, params, batches, steps=6, **args)
    assert [r["step"] for r in rest] == [4, 5, 6]
    chex.assert_trees_all_equal(state, whole)
    assert [r["step"] for r in read_log(path)] == [1, 2, 3, 4, 5, 6]


def test_a_stop_takes_effect_at_the_log_point_that_fetched_it(mlp):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    seen = []

    def stop_at_3(record):
        seen.append(record["step"])
        return np.bool_(record["step"] == 3)

    args = {"steps": 8, "log_every": 2, "progress": False}
    _, history = ddl.fit(strategy, params, make_batches(8, 8), callbacks=[stop_at_3], **args)
    # Records 3 and 4 are fetched together at step 4: every callback sees both.
    assert [r["step"] for r in history] == seen == [1, 2, 3, 4]
    # Evaluations are log points: a stop on an eval result is exact.
    _, history = ddl.fit(
        strategy,
        params,
        make_batches(8, 8),
        eval_fn=lambda p: 1.0,
        eval_every=3,
        callbacks=[lambda record: "eval" in record, lambda record: 1],  # only True stops
        **{**args, "log_every": 10},
    )
    assert [r["step"] for r in history] == [1, 2, 3]


def read_scalars(logdir) -> dict[str, dict[int, float]]:
    """The scalars of a TensorBoard directory's event files, ``{tag: {step: value}}``, as
    TensorBoard shows them (a run's start hides the earlier events of its later steps)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):  # TFRecords: length (8 bytes), its crc, data, data's crc
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            if event.session_log.status == event.session_log.START:  # a purge_step
                for values in scalars.values():
                    for step in [s for s in values if s >= event.step]:
                        del values[step]
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_gets_every_scalar_of_every_record_also_of_a_run_that_raised(
    mlp, tmp_path, monkeypatch
):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    logdir = tmp_path / "tb"
    _, history = ddl.fit(
        strategy,
        params,
        make_batches(5, 8),
        steps=5,
        log_every=2,
        eval_fn=lambda p: {"loss0": loss_fn(p, make_batches(1, 8)[0])},
        eval_every=3,
        progress=False,
        tensorboard_dir=logdir,
    )
    scalars = read_scalars(logdir)
    assert set(scalars) == {"loss", "eval_loss0"}
    assert scalars["loss"] == {r["step"]: r["loss"] for r in history}
    evals = {r["step"]: r["eval_loss0"] for r in history if "eval_loss0" in r}
    assert scalars["eval_loss0"] == evals and list(evals) == [3, 5]
    # A NaN at step 3, fetched with steps 1 and 2 at step 4: those two are still written.
    batches = make_batches(4, 8)
    batches[2]["x"][0, 0] = np.nan
    with pytest.raises(FloatingPointError, match="at step 3"):
        ddl.fit(
            strategy,
            params,
            batches,
            steps=4,
            log_every=4,
            progress=False,
            tensorboard_dir=tmp_path / "raised",
        )
    assert list(read_scalars(tmp_path / "raised")["loss"]) == [1, 2]
    # Only process 0 writes.
    monkeypatch.setattr(fit_log.jax, "process_index", lambda: 1)
    ddl.fit(strategy, params, batches, steps=2, progress=False, tensorboard_dir=tmp_path / "p1")
    assert not (tmp_path / "p1").exists()


def test_tensorboard_without_tensorboardx_names_the_extra(mlp, tmp_path, monkeypatch):
    loss_fn, params = mlp
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX fails
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    with pytest.raises(ImportError, match=re.escape("pip install 'ddl-jax[tensorboard]'")):
        ddl.fit(
            strategy, params, make_batches(2, 8), steps=2, progress=False, tensorboard_dir=tmp_path
        )


def test_a_long_run_without_logging_does_not_deadlock_the_devices(mlp):
    """With no metric fetched for the whole run, steps used to be dispatched without bound,
    and XLA:CPU's collectives over 8 simulated devices deadlocked (the process aborted)."""
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.adam(1e-3), ddl.make_mesh(data=8))
    batch = make_batches(1, 64)[0]
    _, history = ddl.fit(strategy, params, [batch] * 300, steps=300, log_every=10**6)
    assert len(history) == 300 and np.isfinite(history[-1]["loss"])


def test_an_eval_fn_returning_a_vector_is_named(mlp):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8))
    for bad, where in (
        (lambda v: jnp.ones(3), "result is"),
        (lambda v: {"acc": jnp.ones(2)}, "['acc']"),
    ):
        with pytest.raises(TypeError, match=re.escape("fit: eval_fn must return one number")) as e:
            ddl.fit(strategy, params, make_batches(2, 32), steps=2, eval_fn=bad, progress=False)
        assert where in str(e.value)


def _unwritable_folders(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    return {"a file": str(a_file), "under /proc": "/proc/ddl-jax-checkpoints"}


@pytest.mark.parametrize("kind", ["a file", "under /proc"])
def test_a_checkpoint_dir_that_cannot_be_written_fails_before_the_first_step(mlp, tmp_path, kind):
    loss_fn, params = mlp
    folder = _unwritable_folders(tmp_path)[kind]
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8))
    stepped = []

    def batches():
        stepped.append(1)
        yield from make_batches(2, 32)

    with pytest.raises(ValueError, match=f"checkpoint_dir '{re.escape(folder)}' cannot be written"):
        ddl.fit(strategy, params, batches(), steps=2, checkpoint_dir=folder, progress=False)
    assert not stepped


_IMMUTABLE = """
import sys, optax, ddl_jax as ddl
from conftest import make_batches, mlp_pair
loss_fn, params = mlp_pair()
strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=1))
ddl.fit(strategy, params, make_batches(2, 32), steps=2, checkpoint_dir=sys.argv[1], progress=False)
"""


@pytest.mark.skipif(
    shutil.which("chattr") is None or os.geteuid() != 0, reason="needs root's chattr"
)
def test_an_immutable_checkpoint_dir_ends_the_process_in_one_line(tmp_path):
    """The folder exists but cannot be written even by root (``chattr +i``): orbax's
    background save used to fail and leave the process unable to exit."""
    from conftest import child_env

    folder = tmp_path / "locked"
    folder.mkdir()
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("this file system has no immutable attribute")
    try:
        script = [sys.executable, "-c", _IMMUTABLE, str(folder)]
        env = {**child_env(), "PYTHONPATH": str(Path(__file__).parent)}
        out = subprocess.run(script, env=env, capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: checkpoint_dir '{folder}' cannot be written"), out.stderr


def test_an_interrupted_fit_says_which_step_it_resumes_from(mlp, tmp_path, capsys):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8))

    def batches():
        for i, batch in enumerate(make_batches(8, 32)):
            if i == 5:  # Ctrl-C while step 6's batch is drawn
                raise KeyboardInterrupt
            yield batch

    folder = tmp_path / "ckpt"
    with pytest.raises(KeyboardInterrupt):
        ddl.fit(
            strategy, params, batches(), steps=8, checkpoint_dir=folder, checkpoint_every=2,
            progress=False,
        )  # fmt: skip
    said = capsys.readouterr()
    assert (
        f"fit: interrupted; the last complete checkpoint holds step 4 in {folder}: run the "
        "same fit again to resume from it." in said.out + said.err
    )
    _, history = ddl.fit(
        strategy, params, make_batches(8, 32), steps=8, checkpoint_dir=folder, progress=False
    )
    assert history[0]["step"] == 5


def _checkpointed_steps(directory) -> list[int]:
    return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())


def test_a_non_finite_step_is_never_checkpointed_nor_the_last_good_one_dropped(mlp, tmp_path):
    """Checkpoints more often than log points: the loss is fetched and checked before each
    save, so the run stops at the first bad step and the checkpoints before it stay."""
    loss_fn, params = mlp
    batches = make_batches(40, 8)
    batches[11]["x"][0, 0] = np.nan  # step 12
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    ckpt, path = tmp_path / "ckpt", tmp_path / "log.jsonl"
    with pytest.raises(FloatingPointError, match="loss is nan at step 12"):
        ddl.fit(strategy, params, batches, steps=40, log_every=40, checkpoint_every=5,
                checkpoint_dir=ckpt, log_file=path, progress=False)  # fmt: skip
    assert _checkpointed_steps(ckpt) == [5, 10]
    for step in (5, 10):
        variables = ddl.checkpoint.load_variables(ckpt, step)
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(variables))
    # the log holds every step before the bad one (a resume from step 10 drops 11)
    assert [r["step"] for r in read_log(path)] == list(range(1, 12))


def test_an_update_that_overflows_behind_a_finite_loss_is_not_checkpointed(mlp, tmp_path):
    """The learning rate overflows at the optimizer's third update: step 3's loss is
    finite, its new state is not. Saved, it pushed the last good checkpoint out (keep=1)
    and a rerun resumed from it."""
    loss_fn, params = mlp
    rate = lambda count: jnp.where(count == 2, jnp.inf, 0.1)  # noqa: E731
    strategy = ddl.data_parallel(loss_fn, optax.sgd(rate), ddl.make_mesh(data=2))
    ckpt = tmp_path / "ckpt"
    with pytest.raises(FloatingPointError, match="the state after step 3 holds non-finite"):
        ddl.fit(strategy, params, make_batches(6, 8), steps=6, checkpoint_every=1, keep=1,
                checkpoint_dir=ckpt, progress=False)  # fmt: skip
    assert _checkpointed_steps(ckpt) == [2]
    variables = ddl.checkpoint.load_variables(ckpt, 2)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(variables))


def test_a_crash_between_log_points_leaves_no_step_unlogged_after_a_resume(mlp, tmp_path):
    loss_fn, params = mlp
    batches = make_batches(20, 8)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    args = {"log_every": 10, "checkpoint_every": 5, "checkpoint_dir": tmp_path / "ckpt",
            "log_file": tmp_path / "log.jsonl", "progress": False}  # fmt: skip

    def loader_dies_at_18(start):
        for i in range(start, 17):
            yield batches[i]
        raise OSError("the loader died")

    with pytest.raises(OSError, match="the loader died"):
        ddl.fit(strategy, params, loader_dies_at_18, steps=20, **args)
    _, history = ddl.fit(strategy, params, lambda start: batches[start:], steps=20, **args)
    assert history[0]["step"] == 16
    assert [r["step"] for r in read_log(args["log_file"])] == list(range(1, 21))


def test_the_last_step_is_saved_before_a_final_evaluation_that_fails(mlp, tmp_path):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    with pytest.raises(TypeError, match="eval_fn must return one number"):
        ddl.fit(strategy, params, make_batches(6, 8), steps=6, progress=False,
                eval_fn=lambda p: jnp.ones(3), checkpoint_dir=tmp_path)  # fmt: skip
    assert _checkpointed_steps(tmp_path) == [6]  # the training is kept


def test_an_eval_fn_that_is_not_callable_is_refused_before_training(mlp):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    value = loss_fn(params, make_batches(1, 8)[0])
    with pytest.raises(TypeError, match="fit: eval_fn must be callable .variables -> a scalar"):
        ddl.fit(strategy, params, make_batches(2, 8), steps=2, eval_fn=value, progress=False)


def test_a_fresh_run_that_fails_before_its_first_record_leaves_the_log_file_alone(mlp, tmp_path):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    path = tmp_path / "log.jsonl"
    _, history = ddl.fit(strategy, params, make_batches(3, 8), steps=3, log_file=path,
                         progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="not divisible"):
        ddl.fit(strategy, params, make_batches(3, 3), steps=3, log_file=path, progress=False)
    assert read_log(path) == history


def test_a_resume_past_the_batches_says_so(mlp, tmp_path):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    batches = make_batches(4, 8)
    args = {"steps": 8, "checkpoint_dir": tmp_path, "progress": False}
    with pytest.warns(UserWarning, match="ran out after 4 of 8 steps"):
        ddl.fit(strategy, params, batches, **args)
    with pytest.raises(ValueError, match="batches yielded no batch from step 5 on, where the "
                       "run resumes .its checkpoint of step 4 in "):  # fmt: skip
        ddl.fit(strategy, params, batches, **args)


def test_every_step_skipped_warns(mlp):
    loss_fn, params = mlp
    params = jax.tree.map(lambda x: x * np.nan, params)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    with pytest.warns(UserWarning, match="fit: all 3 steps were skipped"):
        _, history = ddl.fit(strategy, params, make_batches(3, 8), steps=3,
                             skip_nonfinite=True, progress=False)  # fmt: skip
    assert [r["skipped"] for r in history] == [1.0] * 3


def test_most_steps_skipped_warns_and_a_few_do_not(mlp):
    """A run that overflows step after step (a loss scale too large, a learning rate that
    diverges) skips most updates: said at the end, as when every step is skipped."""
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))

    def batches(bad):
        out = make_batches(4, 8)
        for i in bad:
            out[i] = {**out[i], "x": out[i]["x"] * np.nan}
        return out

    with pytest.warns(UserWarning, match="fit: 3 of 4 steps were skipped"):
        _, history = ddl.fit(strategy, params, batches([1, 2, 3]), steps=4,
                             skip_nonfinite=True, progress=False)  # fmt: skip
    assert [r["skipped"] for r in history] == [0.0, 1.0, 1.0, 1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddl.fit(strategy, params, batches([1]), steps=4, skip_nonfinite=True, progress=False)


def test_the_log_file_is_strict_json_non_finite_values_null(mlp, tmp_path):
    loss_fn, params = mlp
    params = jax.tree.map(lambda x: x * np.nan, params)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    path = tmp_path / "log.jsonl"
    with pytest.warns(UserWarning, match="skipped"):
        ddl.fit(strategy, params, make_batches(2, 8), steps=2, skip_nonfinite=True,
                log_file=path, progress=False)  # fmt: skip

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    with open(path) as f:
        records = [json.loads(line, parse_constant=refuse) for line in f]
    assert [(r["step"], r["loss"], r["skipped"]) for r in records] == [
        (1, None, 1.0),
        (2, None, 1.0),
    ]


def test_when_no_checkpoint_can_be_restored_fit_says_it_starts_over(mlp, tmp_path, capsys):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    ddl.fit(strategy, params, make_batches(2, 8), steps=2, checkpoint_dir=tmp_path,
            progress=False)  # fmt: skip
    for f in (tmp_path / "2").rglob("*"):
        if f.is_file() and f.stat().st_size:
            f.write_bytes(b"\0" * f.stat().st_size)  # every file of the one checkpoint
    capsys.readouterr()
    with pytest.warns(UserWarning, match="could not be restored"):
        _, history = ddl.fit(strategy, params, make_batches(2, 8), steps=2,
                             checkpoint_dir=tmp_path, progress=False)  # fmt: skip
    assert [r["step"] for r in history] == [1, 2]
    out = capsys.readouterr().out
    assert "fit: none of the 1 checkpoints in " in out and "training from step 0." in out


def test_with_checkpoints_the_log_file_holds_every_evaluation(mlp, tmp_path):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    path = tmp_path / "log.jsonl"
    _, history = ddl.fit(strategy, params, make_batches(5, 8), steps=5, eval_fn=lambda p: 1.0,
                         eval_every=2, checkpoint_every=2, checkpoint_dir=tmp_path / "ckpt",
                         log_file=path, progress=False)  # fmt: skip
    assert [r["step"] for r in history if "eval" in r] == [2, 4, 5]
    assert read_log(path) == history


def test_an_evaluation_and_a_checkpoint_of_one_step_share_strategys_params(mlp, tmp_path):
    """``strategy.params`` (under FSDP a gather of the whole model) once a step where an
    evaluation and a checkpoint fall together, the final step's included."""
    loss_fn, params = mlp
    inner = ddl.fsdp(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), stage=3)
    calls = []

    def counted(state):
        calls.append(int(state.model.step))
        return inner.params(state)

    strategy = ddl.Strategy(inner.init, inner.step, counted)
    ddl.fit(strategy, params, make_batches(8, 8), steps=8, eval_every=2, checkpoint_every=4,
            eval_fn=lambda p: loss_fn(p, make_batches(1, 8)[0]), checkpoint_dir=tmp_path,
            progress=False)  # fmt: skip
    assert calls == [2, 4, 6, 8]


def test_a_second_fit_finds_its_steps_compiled(mlp, caplog):
    """The same strategy fitted again (a sweep, a notebook cell run twice) compiles no
    step again, with ``skip_nonfinite`` (whose guard once was a new function each time)
    and with islands (whose init once jitted a new function each time)."""
    loss_fn, params = mlp
    islands = ddl.make_mesh(island=2, data=4)
    for strategy, options in (
        (ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8)),
         {"skip_nonfinite": True}),
        (ddl.local_sgd(inner=ddl.fsdp(loss_fn, optax.sgd(0.1), islands), period=2), {}),
    ):  # fmt: skip
        ddl.fit(strategy, params, make_batches(2, 8), steps=2, progress=False, **options)
        caplog.clear()
        with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
            ddl.fit(strategy, params, make_batches(2, 8), steps=2, progress=False, **options)
        compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
        assert not compiled, compiled


def test_a_resume_frees_the_fresh_state_before_restoring(mlp, tmp_path, monkeypatch):
    """A resume holds one state, not two: the fresh state only gives the checkpoint's
    shapes and is freed before the restore allocates (a run that fit once in memory
    could not resume)."""
    from ddl_jax._src.train import fit as fit_module

    loss_fn, params = mlp
    strategy = ddl.local_sgd(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=8), period=2)
    options = {"checkpoint_dir": tmp_path, "progress": False}
    state, _ = ddl.fit(strategy, params, make_batches(4, 8), steps=2, **options)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    del state
    real, grown = fit_module.checkpoint.newest_readable, []

    def live_bytes():
        return sum(x.nbytes for x in jax.live_arrays())  # this process's, other tests' too

    def measured(manager, like):
        grown.append(live_bytes() - before)
        return real(manager, like)

    monkeypatch.setattr(fit_module.checkpoint, "newest_readable", measured)
    gc.collect()
    before = live_bytes()
    ddl.fit(strategy, params, make_batches(4, 8), steps=4, **options)
    assert len(grown) == 1 and grown[0] < state_bytes / 2, (grown, state_bytes)
