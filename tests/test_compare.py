"""``ddl-jax compare``: spec parsing, one-line errors with exit code 2, the TOML config,
outputs written, and the same table from the same seed."""

import json
import logging
import math
import re

import jax
import numpy as np
import pytest

from ddl_jax import cli
from ddl_jax._src.strategies import fsdp, gossip
from ddl_jax.compare import report, specs, workloads
from ddl_jax.compare import run as run_module
from ddl_jax.compare.config import make_config
from ddl_jax.compare.specs import (
    DEFAULT_STRATEGIES,
    FAMILIES,
    PRESETS,
    CompareError,
    Spec,
    parse_spec,
)

# JAX's backend starts here, with conftest's 8 CPU devices, so that `compare` cannot
# change the device count of this test process.
DEVICES = len(jax.devices())


def test_the_choices_compare_offers_are_the_librarys():
    # compare uses only the public API, so it spells these out: they must not drift.
    assert specs.TOPOLOGIES == gossip.TOPOLOGIES
    assert specs.STAGES == fsdp.STAGES
    assert specs.GOSSIP_ORDERS == gossip.ORDERS


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("sync", Spec("sync", "sync", None)),
        ("local:16", Spec("local:16", "local", 16)),
        ("local", Spec("local:16", "local", 16)),  # the family's default parameter
        ("diloco:4", Spec("diloco:4", "diloco", 4)),
        ("topk:0.01", Spec("topk:0.01", "topk", 0.01)),
        ("powersgd:2", Spec("powersgd:2", "powersgd", 2)),
        ("qsgd", Spec("qsgd:4", "qsgd", (4, "l2"))),
        ("qsgd:1:max", Spec("qsgd:1:max", "qsgd", (1, "max"))),
        ("ssp:0", Spec("ssp:0", "ssp", 0)),
        ("async", Spec("async", "async", None)),
        ("async:inverse", Spec("async:inverse", "async", "inverse")),  # an optional one
        ("softsync:8", Spec("softsync:8", "softsync", (8, None))),
        ("softsync:8:exp", Spec("softsync:8:exp", "softsync", (8, "exp"))),
        ("fsdp", Spec("fsdp:3", "fsdp", 3)),
        ("gossip:torus", Spec("gossip:torus", "gossip", ("torus", "dpsgd"))),
        (
            "gossip:ring:adapt_then_combine",
            Spec("gossip:ring:adapt_then_combine", "gossip", ("ring", "adapt_then_combine")),
        ),
        ("diloco/fsdp", Spec("diloco:16/fsdp:3", "diloco", 16, Spec("fsdp:3", "fsdp", 3))),
        ("local:4/sync", Spec("local:4/sync", "local", 4, Spec("sync", "sync", None))),
    ],
)
def test_parse_spec(text, spec):
    assert parse_spec(text) == spec


def test_defaults_cover_every_family():
    assert {parse_spec(s).family for s in DEFAULT_STRATEGIES} == set(FAMILIES)


BAD = [
    (["--strategies", "sync,nope"], "unknown strategy 'nope' in 'nope'; valid names: sync, ring"),
    (["--strategies", "local:abc"], "expected the period H, an integer >= 1"),
    (["--strategies", "topk:2"], "expected the ratio of entries sent, a number in (0, 1]"),
    (["--strategies", "gossip:star"], "expected a topology, one of ring, torus"),
    (["--strategies", "gossip:ring:push"], "then :ORDER, one of dpsgd, adapt_then_combine"),
    (["--strategies", "fsdp:4"], "expected the ZeRO stage, 1, 2 or 3"),
    (["--strategies", "sync:3"], "strategy 'sync' takes no parameter"),
    (["--strategies", "async:fast"], "expected a staleness rule for the server's step, inverse"),
    (["--strategies", "softsync:8:fast"], "an integer >= 1, then optionally a staleness rule"),
    (["--strategies", "qsgd:128"], "expected the levels a sign, an integer in [1, 127]"),
    (["--strategies", "qsgd:4:inf"], "then :max for QSGDinf's scale"),
    (["--strategies", "sync,sync"], "strategy 'sync' is listed twice"),
    (["--strategies", ""], "strategies must be a comma-separated list"),
    (["--network", "5g"], "unknown network '5g'; valid: 1gbps, 10gbps, 100gbps, ici"),
    (["--workload", "mnist"], "unknown workload 'mnist'; valid: digits-mlp, digits-cnn"),
    (["--steps", "0"], "steps must be an integer >= 1, got 0"),
    (["--steps", "-3"], "steps must be an integer >= 1, got -3"),
    (["--steps", "ten"], "steps must be an integer >= 1, got 'ten'"),
    (["--straggler", "0.5"], "straggler must be a number >= 1, got 0.5"),
    (["--devices", str(DEVICES + 1)], f"than the {DEVICES} cpu device(s) JAX started with; "),
    (["--strategies", f"softsync:{DEVICES + 1}"], f"softsync:{DEVICES + 1}: softsync n="),
    (["--devices", "3", "--strategies", "sync,adasum"], "adasum: adasum: the mesh axis"),
    (["--target", "95"], "target 95 is not an accuracy in (0, 1]"),
    (["--target", "95", "--steps", "3"], "test accuracy); e.g. --target 0.95."),
    (["--target", "0"], "test accuracy); e.g. --target 0.9."),
    (["--target", "-0.5"], "target -0.5 is not an accuracy in (0, 1]"),
    (["--target=-inf"], "target must be finite, got -inf"),
    (["--target", "0.01"], "the untrained model already meets the target (test accuracy 0."),
    (["--strategies", "streaming:3"], "expected the fragments P, an integer dividing 16"),
    (["--strategies", "asynclocal:5"], "H=5 inner steps do not divide the 16 rows a worker ge"),
    (["--strategies", "asynclocal:5"], "choose a divisor, e.g. asynclocal:4."),
    (["--preset", "fast"], "unknown preset 'fast'; valid: default, low-bandwidth, unreliable, isl"),
    (["--preset", "unreliable", "--strategies", "sync"], "strategies or a preset, not both"),
    (["--preset", "unreliable", "--drop", "1"], "drop must be a probability in [0, 1), got 1"),
    (["--drop", "0.1"], "drop: fsdp:3, streaming:4, noloco:16, topk:0.01, demo:0.0625, sign,"),
    (["--churn", "1"], "churn must be a probability in [0, 1), got 1"),
    (["--churn", "-0.1"], "churn must be a number >= 0, got -0.1"),
    (["--churn", "0.1"], "churn: fsdp:3, streaming:4, noloco:16, topk:0.01, demo:0.0625,"),
    (["--non-iid", "0"], "non_iid (a Dirichlet alpha) must be a finite number > 0, got 0.0"),
    (["--non-iid", "nan"], "non_iid (a Dirichlet alpha) must be a finite number > 0, got nan"),
    (
        ["--non-iid", "0.5", "--workers", "1024", "--strategies", "sync"],
        "the workload's batches: dirichlet_shares: in 100 draws at alpha=0.5 some of the 1024",
    ),
    (["--workload", "text-gpt", "--non-iid", "0.5"], "a digits workload, not text-gpt"),
    (["--strategies", "ssp/fsdp:3"], "cannot stack 'ssp/fsdp:3': the outer method"),
    (["--strategies", "diloco:16/gossip"], "the inner one of sync, fsdp"),
    (["--strategies", "diloco/fsdp:4"], "expected the ZeRO stage, 1, 2 or 3"),
    (["--islands", "1"], "islands must be an integer >= 2, got 1"),
    (["--islands", "3", "--strategies", "diloco/sync"], "devices=8 do not split into islands=3"),
    (["--inner-network", "5g"], "unknown inner_network '5g'; valid: 1gbps"),
    (["--islands", "4"], "islands shape stacked strategies (OUTER/INNER, e.g. diloco:16/fsdp:3)"),
    (["--strategies", "sync", "--inner-network", "1gbps"], "and none is listed: add one, or drop"),
    (["--workers", "12"], "workers=12 must be a multiple of devices=8"),
    (["--workers", "16", "--strategies", "sync,fsdp:3"], "fsdp:3: fsdp splits its state over"),
    (["--workers", "16", "--strategies", "ring"], "ring: a worker's compute in the ring grows"),
    (
        ["--workers", "16", "--strategies", "gossip:exponential"],
        "gossip:exponential with several workers a device is priced from the device shifts",
    ),
    (
        ["--devices", "2", "--workers", "8", "--strategies", "gossip"],
        "gossip:ring on 2 devices with several workers a device is priced from the device",
    ),
    (["--workers", "16", "--strategies", "diloco/sync"], "which islands do not"),
    (["--workers", "16", "--strategies", "async", "--measure"], "drop measure or workers"),
    (["--workers", "0"], "workers must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_code_2(args, message, capsys, tmp_path):
    assert cli.main(["compare", "--steps", "2", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("ddl-jax compare: error: ")
    assert message in err


def test_argparse_errors_also_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["compare", "--no-such-flag"])
    assert e.value.code == 2


def test_toml_config_is_checked_by_the_same_code(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('strategies = ["sync", "local:abc"]\n')
    assert cli.main(["compare", "--config", str(path)]) == 2
    from_file = capsys.readouterr().err
    assert cli.main(["compare", "--strategies", "sync,local:abc"]) == 2
    assert capsys.readouterr().err == from_file

    path.write_text('network = "5g"\nstepz = 3\n')
    assert cli.main(["compare", "--config", str(path)]) == 2
    assert "unknown setting(s) stepz; valid: workload, strategies" in capsys.readouterr().err

    # Flags override the file: the file's bad network is never checked.
    path.write_text('network = "5g"\n')
    assert cli.main(["compare", "--config", str(path), "--network", "1gbps", "--steps", "0"]) == 2
    assert "steps must be an integer >= 1" in capsys.readouterr().err

    for strategies in ("5", '{sync = 1, "local:16" = 2}'):  # not a list of specs
        path.write_text(f"strategies = {strategies}\n")
        assert cli.main(["compare", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert "strategies must be a comma-separated string of specs" in err
        assert err.count("\n") == 1, err

    path.write_text("steps = [\n")
    assert cli.main(["compare", "--config", str(path)]) == 2
    assert "is not valid TOML" in capsys.readouterr().err
    assert cli.main(["compare", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read config" in capsys.readouterr().err


def test_make_config_accepts_toml_values():
    config = make_config({"strategies": ["sync", "topk:0.1"], "steps": 5, "straggler": 2})
    assert [s.text for s in config.strategies] == ["sync", "topk:0.1"]
    assert (config.steps, config.straggler, config.network) == (5, 2.0, "1gbps")
    with pytest.raises(CompareError, match="seed must be an integer >= 0"):
        make_config({"seed": -1})
    # a metric of one's own may be negative (a log-likelihood): any finite target
    assert make_config({"target": "-2.5"}).target == -2.5


def _tiny(out, config):
    config.write_text(
        'workload = "digits-mlp"\nstrategies = "sync,local:4"\nsteps = 12\neval_every = 4\n'
    )
    assert cli.main(["compare", "--config", str(config), "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


def test_same_seed_same_table_and_files_written(tmp_path, capsys, caplog):
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        first = _tiny(tmp_path / "a", tmp_path / "c.toml")
    # each strategy's step compiled once: bytes and compute are read from fit's program
    assert sum(r.getMessage().startswith("Compiling jit(step)") for r in caplog.records) == 2
    second = _tiny(tmp_path / "b", tmp_path / "c.toml")
    printed = capsys.readouterr().out
    assert "| sync |" in printed and "| local:4 |" in printed
    # Not a terminal (a notebook, a pipe): one line per finished run, no step-by-step ones.
    assert "step 4" not in printed and "loss=" not in printed
    assert printed.count("[1/2] sync: test accuracy ") == 2
    assert printed.count("[2/2] local:4: test accuracy ") == 2
    # Times are priced from the compiled programs, not timed: the same in both runs, and
    # so the ranking.
    exact = ("final", "eval_values", "eval_steps", "eval_bytes", "bytes_per_device_per_step")
    exact += ("eval_seconds", "compute_flops_per_step", "compute_ms_per_step", "rank")
    for a, b in zip(first["runs"], second["runs"], strict=True):
        assert {k: a[k] for k in exact} == {k: b[k] for k in exact}
        assert a["eval_steps"] == [4, 8, 12]
        assert a["compute_flops_per_step"] > 0
    sync, local = first["runs"]
    # Local SGD with H = 4 sends a quarter of synchronous SGD's bytes, plus its small loss
    # all-reduce every step.
    assert local["bytes_per_device_per_step"] < 0.3 * sync["bytes_per_device_per_step"]
    assert first["config"]["strategies"] == ["sync", "local:4"]
    out = tmp_path / "a"
    table = (out / "results.md").read_text()
    assert table.count("\n| ") == 5  # header, sync, local:4; the crossover header, local:4
    for name in ("accuracy_vs_steps", "accuracy_vs_bytes", "accuracy_vs_time"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each run's records, from fit's log_file.
    for run, name in ((sync, "sync"), (local, "local_4")):
        lines = (out / "logs" / f"{name}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["step"] for r in records] == list(range(1, 13))
        assert [r["eval"] for r in records if "eval" in r] == run["eval_values"]
        assert records[-1]["loss"] == run["final_loss"]


def _run(out, *args):
    assert cli.main(["compare", "--out", str(out), "--eval-every", "4", *args]) == 0
    return {r["strategy"]: r for r in json.loads((out / "results.json").read_text())["runs"]}


def test_the_answer_line_names_the_first_to_the_target_its_ties_and_syncs_time(tmp_path):
    _run(tmp_path, "--strategies", "sync,local:4", "--steps", "40", "--target", "0.8")
    results = json.loads((tmp_path / "results.json").read_text())
    assert "\nAnswer: on 1gbps, " in (tmp_path / "results.md").read_text()
    sync, local = results["runs"]
    # sync first, alone
    sync["rank"], local["rank"] = 1, 2
    t = sync["simulated_seconds_to_target"]
    answer = (
        f"Answer: on 1gbps, sync reaches test accuracy >= 0.8 first ({1e3 * t:.3g} ms simulated)."
    )
    assert f"\n{answer}\n" in report.markdown(results)
    # local SGD first, sync later: sync's time beside it, as a multiple
    sync["rank"], local["rank"] = 2, 1
    ratio = t / local["simulated_seconds_to_target"]
    assert f"; sync takes {1e3 * t:.3g} ms, {ratio:.2g}x as long." in report.markdown(results)
    # tied: both named, from the first time to the last
    sync["rank"] = 1
    times = sorted(1e3 * r["simulated_seconds_to_target"] for r in (sync, local))
    assert (
        f"sync and local:4 reach test accuracy >= 0.8 first ({times[0]:.3g} ms to "
        f"{times[1]:.3g} ms simulated, tied: evaluations every 4 steps cannot order them)."
    ) in report.markdown(results)
    # sync diverged: the answer says it does not reach the target
    sync["rank"], sync["diverged"] = None, True
    assert "local:4 reaches test accuracy >= 0.8 first (" in report.markdown(results)
    assert "simulated); sync does not reach it." in report.markdown(results)


def test_when_no_strategy_reaches_the_target_the_table_says_which_target_would_be_met(tmp_path):
    runs = _run(tmp_path, "--strategies", "sync,local:4", "--steps", "8", "--target", "0.99")
    assert all(r["steps_to_target"] is None for r in runs.values())
    assert "Answer:" not in (tmp_path / "results.md").read_text()
    best = max(runs.values(), key=lambda r: max(r["eval_values"]))
    value = max(best["eval_values"])
    table = (tmp_path / "results.md").read_text()
    assert (
        f"No strategy reached the target in 8 steps: the best test accuracy any reached was "
        f"{value:.4g} ({best['strategy']}). Train longer (--steps), or give a target that run "
        f"met (e.g. --target {math.floor(value * 100) / 100:g})." in table
    )
    _run(tmp_path, "--strategies", "sync", "--steps", "8", "--target", "0.5")  # reached
    assert "No strategy reached" not in (tmp_path / "results.md").read_text()


# DES-LOC's first-moment average without the second's spikes the loss here (a worker whose
# second moment is ~0 where the others' first is not): fit's warning says so.
@pytest.mark.filterwarnings("ignore:fit. the loss grew")
def test_desloc_is_charged_its_moment_averages_and_consensus_is_reported(tmp_path, capsys):
    """On label-skewed shares: DES-LOC (H = 2) averages the parameters as local SGD (H = 2)
    does, plus Adam's first moment once in 8 steps (at 3H = 6), an all-reduce of the same
    size; local SGD's replicas agree after its last synchronisation, Streaming DiLoCo's
    (one fragment sent in 8 steps) do not."""
    runs = _run(
        tmp_path, "--strategies", "local:2,desloc:2,streaming:2", "--steps", "8", "--non-iid", "0.3"
    )
    local, desloc, streaming = runs["local:2"], runs["desloc:2"], runs["streaming:2"]
    assert (local["events"], desloc["events"], streaming["events"]) == (4.0, 5.0, 1.0)
    extra = desloc["bytes_per_device_total"] - local["bytes_per_device_total"]
    assert extra == pytest.approx(local["comm_bytes_per_event"], rel=1e-9)
    assert local["consensus_distance"] == 0.0 < streaming["consensus_distance"]
    assert "| desloc:2 |" in capsys.readouterr().out


def test_gossip_takes_its_order(tmp_path):
    """gossip:TOPOLOGY:adapt_then_combine mixes the updated models: the same bytes as D-PSGD's
    order, another run."""
    runs = _run(tmp_path, "--strategies", "gossip:ring,gossip:ring:adapt_then_combine",
                "--steps", "4")  # fmt: skip
    dpsgd, atc = runs["gossip:ring"], runs["gossip:ring:adapt_then_combine"]
    assert dpsgd["bytes_per_device_per_step"] == atc["bytes_per_device_per_step"]
    # mixing after the step leaves the replicas closer (0.167 against 0.337 after 4 steps)
    assert atc["consensus_distance"] < 0.75 * dpsgd["consensus_distance"]


def test_one_peer_gossip_is_charged_one_round_a_step(tmp_path):
    """A round with one peer sends the parameters once a step, in one of the step's
    branches: priced every step, as much as one round of the static ring's two."""
    runs = _run(tmp_path, "--strategies", "gossip:one_peer_exponential,gossip", "--steps", "8")
    one, ring = runs["gossip:one_peer_exponential"], runs["gossip:ring"]
    params = workloads.make_workload("digits-mlp", seed=0, devices=8).params
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert one["events"] == 8.0
    assert one["comm_bytes_per_event"] == pytest.approx(model_bytes, rel=1e-9)
    assert one["bytes_per_device_total"] == pytest.approx(
        8 * (one["comm_bytes_per_step"] + model_bytes), rel=1e-9
    )
    assert ring["comm_bytes_per_step"] == pytest.approx(
        one["comm_bytes_per_step"] + 2 * model_bytes, rel=1e-9
    )
    assert one["consensus_distance"] > 0


def test_a_stacked_strategy_prices_its_islands_collectives_on_the_inner_network(tmp_path):
    """DiLoCo over FSDP on 2 islands of 4: a synchronisation sends each device's quarter of
    the model across islands (an all-reduce between 2), on --network; FSDP's collectives
    stay inside the islands and are priced on --inner-network, with the compute."""
    options = ("--strategies", "diloco:2/fsdp:3", "--steps", "4")
    fast = _run(tmp_path / "fast", *options, "--inner-network", "ici")["diloco:2/fsdp:3"]
    slow = _run(tmp_path / "slow", *options, "--inner-network", "1gbps")["diloco:2/fsdp:3"]
    params = workloads.make_workload("digits-mlp", seed=0, devices=8).params
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert fast["events"] == 2.0
    assert fast["consensus_distance"] == 0.0  # the islands measured, synchronised at step 4
    assert fast["comm_bytes_per_event"] == pytest.approx(model_bytes / 4, rel=0.01)
    assert fast["comm_bytes_per_step"] <= 8  # across islands every step: the loss
    assert slow["compute_ms_per_step"] > fast["compute_ms_per_step"]
    assert (slow["comm_s_per_event"], slow["final"]) == (fast["comm_s_per_event"], fast["final"])
    assert (tmp_path / "fast" / "logs" / "diloco_2_over_fsdp_3.jsonl").exists()
    # a straggler slows the compute, not the islands' network: their time is added alike
    slowed = ("--straggler", "4")
    fast4 = _run(tmp_path / "fast4", *options, *slowed, "--inner-network", "ici")
    slow4 = _run(tmp_path / "slow4", *options, *slowed, "--inner-network", "1gbps")
    inner = slow["simulated_seconds_total"] - fast["simulated_seconds_total"]
    assert inner > 0
    total = "simulated_seconds_total"
    assert slow4["diloco:2/fsdp:3"][total] - fast4["diloco:2/fsdp:3"][total] == pytest.approx(inner)
    note = "a stacked strategy's bytes are those crossing islands, and what moves inside an "
    assert note + "island is priced as time on its ici network" in (
        (tmp_path / "fast" / "results.md").read_text().replace("\n", " ")
    )


def test_the_crossover_table_names_its_baseline_where_sync_is_not_run(tmp_path):
    _run(tmp_path, "--strategies", "local:2,gossip", "--steps", "4")  # neither reaches it
    text = (tmp_path / "results.md").read_text()
    assert "Against local:2 (which does not reach the target), on bandwidths" in text


def test_one_device_plots_its_bytes_on_a_linear_axis_without_a_warning(tmp_path, recwarn):
    _run(tmp_path, "--devices", "1", "--strategies", "sync", "--steps", "4")
    assert not [w for w in recwarn if "log-scaled" in str(w.message)]
    assert (tmp_path / "accuracy_vs_bytes.png").exists()


def test_an_out_folder_used_again_holds_only_this_runs_logs(tmp_path):
    _run(tmp_path, "--strategies", "sync,local:4,diloco:2/sync", "--steps", "2")
    (tmp_path / "logs" / "notes.jsonl").write_text("{}\n")  # the user's: kept
    _run(tmp_path, "--strategies", "sync", "--steps", "2")
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["notes.jsonl", "sync.jsonl"]


def test_dropped_synchronisations_leave_the_replicas_apart(tmp_path, capsys):
    runs = _run(tmp_path, "--strategies", "local:2", "--steps", "4", "--drop", "0.5")
    assert runs["local:2"]["consensus_distance"] > 0
    assert "| local:2 |" in capsys.readouterr().out


def test_lost_gradients_and_absent_workers_in_every_unreliable_family(tmp_path):
    """The unreliable preset's baseline, sync, under --drop: each step the mean over the
    workers whose gradient arrived (torchft's participants), logged as their share. Under
    --churn it misses an absent worker's gradient as a lost one (the same draws), local
    SGD and gossip leave it out of steps, the async family's workers leave after a task and
    come back."""
    specs = "sync,local:2,gossip:ring,async"
    _run(tmp_path / "churn", "--strategies", specs, "--steps", "6", "--churn", "0.5")
    _run(tmp_path / "drop", "--strategies", "sync", "--steps", "6", "--drop", "0.5")
    _run(tmp_path / "reliable", "--strategies", "sync", "--steps", "6")

    def log(run, name):
        return [json.loads(line) for line in (tmp_path / run / "logs" / f"{name}.jsonl").open()]

    lossy, reliable = log("drop", "sync"), log("reliable", "sync")
    assert all(0 <= r["arrived"] <= 1 for r in lossy) and min(r["arrived"] for r in lossy) < 1
    assert "arrived" not in reliable[0]
    assert lossy[0]["loss"] == reliable[0]["loss"]  # the same first step
    assert lossy[-1]["loss"] != reliable[-1]["loss"]  # then lost gradients
    assert PRESETS["unreliable"][0] == "sync"
    assert log("churn", "sync") == lossy
    assert min(r["arrived"] for r in log("churn", "local_2") if r["synchronised"]) < 1
    assert min(r["workers_present"] for r in log("churn", "gossip_ring")) < 8
    assert max(r["workers_away"] for r in log("churn", "async")) > 0
    assert "churn 0.5" in (tmp_path / "churn" / "results.md").read_text().splitlines()[0]


USER_MODULE = """
from ddl_jax.compare import make_workload


def make(seed, devices):
    return make_workload("digits-mlp", seed=seed, devices=devices)._replace(name="mine")


def no_keywords(model):
    raise AssertionError("not called")


def vector_metric(seed, devices):
    w = make_workload("digits-mlp", seed=seed, devices=devices)
    return w._replace(evaluate=lambda params: w.evaluate(params) * jnp.ones(3))


def dict_metric(seed, devices):
    w = make_workload("digits-mlp", seed=seed, devices=devices)
    return w._replace(evaluate=lambda params: {"accuracy": w.evaluate(params)})


def text_metric(seed, devices):
    w = make_workload("digits-mlp", seed=seed, devices=devices)
    return w._replace(evaluate=lambda params: "0.5")


def wrong_batch_size(seed, devices):
    return make_workload("digits-mlp", seed=seed, devices=devices)._replace(batch_size=7)


def any_keywords(**options):
    return make(options["seed"], options["devices"])


def loss_raises(seed, devices):
    def loss(params, batch):
        raise RuntimeError("my loss is broken")

    return make(seed, devices)._replace(loss_fn=loss)


def _loss(seed, devices, change):
    w = make(seed, devices)
    return w._replace(loss_fn=lambda params, batch: change(w.loss_fn(params, batch)))


def negative_loss(seed, devices):  # the same gradients, a loss below 0 that falls
    return _loss(seed, devices, lambda loss: loss - 2.3)


def nan_loss_later(seed, devices):
    return _loss(seed, devices, lambda loss: jnp.where(loss < 1.0, jnp.nan, loss))


def nan_metric_later(seed, devices):  # nan once the parameters moved
    w = make(seed, devices)
    first = jax.tree.leaves(w.params)[0]
    moved = lambda params: jnp.abs(jax.tree.leaves(params)[0] - first).max() > 0
    return w._replace(evaluate=lambda p: jnp.where(moved(p), jnp.nan, w.evaluate(p)))


def few_batches(seed, devices):
    w = make(seed, devices)
    return w._replace(batches=lambda start: itertools.islice(w.batches(start), 4 - start))


def shared_iterator(seed, devices):  # a loader wrapped as is: one iterator for all
    w = make(seed, devices)
    shared = w.batches(0)
    return w._replace(batches=lambda start: shared)


def percent_accuracy(seed, devices):
    w = make(seed, devices)
    return w._replace(evaluate=lambda params: 100 * w.evaluate(params), target=30.0,
                      metric="test accuracy (%)")


def odd_batch(seed, devices):  # 100 rows a batch: no worker count here divides them
    w = make(seed, devices)
    rows = lambda start: (jax.tree.map(lambda x: x[:100], b) for b in w.batches(start))
    return w._replace(batches=rows, batch_size=100)


def cross_entropy(seed, devices):
    w = make(seed, devices)
    test = ddl.data.digits()[1]
    return w._replace(evaluate=lambda params: w.loss_fn(params, test), target=2.0,
                      metric="test cross-entropy", higher_is_better=False)


import itertools

import jax
import jax.numpy as jnp

import ddl_jax as ddl
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module outside the package, ``user_workloads``, importable from the cwd."""
    (tmp_path / "user_workloads.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_users_workload_runs_through_the_cli_and_python_as_the_bundled_one(
    user_module, tmp_path, capsys
):
    flags = ["--strategies", "sync,local:4", "--steps", "8", "--eval-every", "4"]
    bundled = _run(tmp_path / "bundled", *flags)
    cli_user = _run(tmp_path / "cli", *flags, "--workload", "user_workloads:make")
    import user_workloads

    from ddl_jax.compare import compare

    api = compare(
        user_workloads.make(seed=0, devices=DEVICES),
        "sync,local:4",
        steps=8,
        eval_every=4,
        out=str(tmp_path / "api"),
    )
    api = {r["strategy"]: r for r in api["runs"]}
    for runs in (cli_user, api):
        assert runs == bundled
    table = (tmp_path / "api" / "results.md").read_text().splitlines()[2:]
    assert table == (tmp_path / "bundled" / "results.md").read_text().splitlines()[2:]


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        ("user_workloads:nothing", "cannot load it"),
        ("no_such_module:make", "cannot load it"),
        ("user_workloads:no_keywords", "needs model; it may take any of seed, devices"),
        ("user_workloads:vector_metric", "evaluate(params) must return one finite number"),
        ("user_workloads:dict_metric", "one finite number (the metric), got dict {'accuracy'"),
        ("user_workloads:text_metric", "one finite number (the metric), got str '0.5'"),
        ("user_workloads:wrong_batch_size", "batch_size=7, but the first batch of batches(0) has"),
        ("user_workloads:loss_raises", "run this workload here: RuntimeError: my loss is broken"),
        ("user_workloads:shared_iterator", "batches(0) called twice gave different first"),
        ("user_workloads:odd_batch", "global batch of 100 rows does not split over 8 workers"),
    ],
)
def test_a_broken_user_workload_is_one_line_and_exit_code_2(
    user_module, workload, message, capsys, tmp_path
):
    args = ["compare", "--workload", workload, "--steps", "2", "--out", str(tmp_path / "o")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_users_accuracy_in_percent_and_progress_lines_off_a_terminal(
    user_module, tmp_path, capsys, monkeypatch
):
    """A workload of one's own may count accuracy in percent (its own target says so); on
    output that is not a terminal (here, captured) a long strategy prints a line now and
    then, where a terminal shows fit's progress bar."""
    monkeypatch.setattr(run_module, "HEARTBEAT_SECONDS", 0.0)
    runs = _run(tmp_path, "--workload", "user_workloads:percent_accuracy", "--strategies",
                "sync", "--steps", "4")  # fmt: skip
    assert runs["sync"]["final"] > 1  # in percent
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["workload"]["target"] == 30.0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if ": step " in line]
    steps = [re.fullmatch(r"\[1/1\] sync: step (\d)/4, loss \d\.\d+", line) for line in lines]
    assert [m[1] for m in steps] == ["1", "2", "3", "4"], lines


def test_settings_that_cannot_reach_a_users_workload_are_refused(user_module, tmp_path, capsys):
    args = ["compare", "--steps", "2", "--out", str(tmp_path / "o"), "--non-iid", "0.5"]
    assert cli.main([*args, "--workload", "user_workloads:make"]) == 2
    err = capsys.readouterr().err
    assert "'user_workloads:make' does not take non_iid" in err and err.count("\n") == 1, err
    # A function taking **options gets them all.
    keywords = ["--strategies", "sync", "--workload", "user_workloads:any_keywords"]
    assert cli.main([*args[:-2], *keywords]) == 0
    import user_workloads

    from ddl_jax.compare import compare

    with pytest.raises(CompareError, match="non_iid shapes the batches of a workload"):
        compare(user_workloads.make(0, DEVICES), "sync", non_iid=0.5)
    with pytest.raises(CompareError, match="not a ddl_jax.compare.Workload; call it"):
        compare(user_workloads.make, "sync")
    # Processes build the workload themselves: a built one, even under a bundled name,
    # cannot tell them how.
    renamed = user_workloads.make(0, DEVICES)._replace(name="digits-mlp")
    for setting in ({"measure": True}, {"emulate": "100mbit"}):
        with pytest.raises(CompareError, match="--workload module:function --measure"):
            compare(renamed, "sync", **setting)


def test_divergence_is_the_loss_growing_or_going_non_finite(user_module, tmp_path, capsys):
    """A loss below 0 that falls is training; a loss that goes nan, or a metric, is a
    diverged run: marked, unranked, its curve up to then kept."""
    flags = ["--strategies", "sync,local:4", "--steps", "12", "--target", "0.3"]
    falls = _run(tmp_path / "a", *flags, "--workload", "user_workloads:negative_loss")
    for run in falls.values():
        assert run["final_loss"] < -0.5 and not run["diverged"] and run["rank"] is not None, run
    nan = _run(tmp_path / "b", *flags, "--workload", "user_workloads:nan_loss_later")
    run = nan["sync"]  # local SGD's loss stays above 1 in these steps
    assert run["diverged"] and run["rank"] is None, run
    assert run["diverged_why"].startswith("loss is nan at step ")
    assert 0 < len(run["eval_values"]) < 3 and run["final_loss"] >= 1.0, run
    assert not nan["local:4"]["diverged"] and nan["local:4"]["rank"] == 1
    assert "sync: test accuracy" in capsys.readouterr().out
    table = (tmp_path / "b" / "results.md").read_text()
    assert "| - | sync |" in table and "failed" not in table
    # where local SGD stopped on a nan its replicas were not measured: no distance (it was
    # the initial state's 0)
    late = _run(tmp_path / "d", "--strategies", "local:2", "--steps", "18", "--target", "0.3",
                "--workload", "user_workloads:nan_loss_later")["local:2"]  # fmt: skip
    assert late["diverged"] and late["consensus_distance"] is None, late
    metric = _run(tmp_path / "c", *flags, "--workload", "user_workloads:nan_metric_later")
    assert all(run["diverged"] and run["rank"] is None for run in metric.values())
    text = (tmp_path / "c" / "results.json").read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))


def test_ranks_leave_out_diverged_runs():
    def run(low, high, diverged=False):
        return {"simulated_seconds_before_target": low, "simulated_seconds_to_target": high,
                "diverged": diverged}  # fmt: skip

    assert run_module.ranks([run(0.0, 1.0, True), run(1.5, 2.0)]) == [None, 1]


def test_a_run_whose_batches_ran_out_is_priced_per_step_trained(user_module, tmp_path, capsys):
    flags = ["--strategies", "sync", "--steps", "8", "--workload", "user_workloads:few_batches"]
    sync = _run(tmp_path, *flags)["sync"]
    assert sync["steps_trained"] == 4
    assert sync["bytes_per_device_per_step"] == sync["comm_bytes_per_step"]
    assert "batches ran out after 4 of 8 steps" in capsys.readouterr().err
    header = (tmp_path / "results.md").read_text().splitlines()[0]
    assert "8 steps asked, 4 trained (the batches ran out) x " in header, header


def test_figures_are_named_by_the_metric(user_module, tmp_path):
    flags = ["--strategies", "sync", "--steps", "4", "--workload", "user_workloads:cross_entropy"]
    _run(tmp_path, *flags)
    assert (tmp_path / "test_cross_entropy_vs_steps.png").exists()


def test_a_flag_overrides_the_configs_strategies_or_preset(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(run_module, "run_compare", lambda c: seen.append(c) or {"runs": []})
    path = tmp_path / "c.toml"
    path.write_text('strategies = "sync,local:4"\n')
    assert cli.main(["compare", "--config", str(path), "--preset", "unreliable"]) == 0
    path.write_text('preset = "unreliable"\n')
    assert cli.main(["compare", "--config", str(path), "--strategies", "sync"]) == 0
    assert seen[0].preset == "unreliable" and [s.text for s in seen[1].strategies] == ["sync"]


def test_async_is_priced_as_a_parameter_server_and_times_reprice_on_any_network(tmp_path, capsys):
    tensorboard = tmp_path / "tb"
    flags = ["--strategies", "sync,local:4,async,ssp:2", "--steps", "12", "--target", "0.3"]
    runs = _run(tmp_path, *flags, "--tensorboard", str(tensorboard))
    sync, push = runs["sync"], runs["async"]
    params = sum(x.nbytes for x in jax.tree.leaves(_bundled_params()))
    # A push sends the gradient (its share per device), a fetch brings the parameters
    # back; its compute is a data-parallel step's, not its SPMD simulation's.
    assert push["comm_bytes_per_event"] == pytest.approx(params / DEVICES)
    assert push["comm_s_per_event"] == pytest.approx(50e-6 + params / (1e9 / 8))
    assert push["comm_s_per_fetch"] == push["comm_s_per_event"]
    assert push["compute_ms_per_step"] == pytest.approx(sync["compute_ms_per_step"])
    # Plain async fetches after every push; SSP's workers read their cached copies while
    # they are within the bound, and fetch about half as often here.
    assert push["fetches"] == push["events"] > 0
    assert 0.3 * runs["ssp:2"]["events"] < runs["ssp:2"]["fetches"] < 0.7 * runs["ssp:2"]["events"]
    assert "fetches" not in sync and "fetches_to_target" not in runs["local:4"]
    # The crossover sweep re-prices each run from its alpha-beta terms: on the run's own
    # network it gives the table's time.
    for run in runs.values():
        assert run["simulated_seconds_to_target"] is not None, run["strategy"]
        again = report.time_to_target(run, 1e9 / 8, 50e-6)
        assert again == pytest.approx(run["simulated_seconds_to_target"])
    table = (tmp_path / "results.md").read_text()
    assert "| strategy | reaches the target sooner |" in table
    assert (tmp_path / "time_vs_bandwidth.png").read_bytes()[:4] == b"\x89PNG"
    for name in ("sync", "local_4", "async", "ssp_2"):
        assert list((tensorboard / name).glob("events.out.tfevents.*")), name


def test_a_tensorboard_folder_used_again_holds_one_run_a_strategy(tmp_path):
    """A compare run again into the same --tensorboard replaces its strategies' event files
    (TensorBoard drew both runs' curves as one run); other runs in the folder stay."""
    tensorboard = tmp_path / "tb"
    theirs = tensorboard / "their_run" / "events.out.tfevents.1.host"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"")
    for _ in range(2):
        _run(tmp_path, "--strategies", "sync", "--steps", "2", "--tensorboard", str(tensorboard))
    assert len(list((tensorboard / "sync").glob("events.out.tfevents.*"))) == 1
    assert theirs.exists()


def test_async_with_a_staleness_rule_scales_the_servers_step(tmp_path):
    """64 workers: pushes about 63 updates stale (softsync(4)'s groups about 16). Plain
    async and softsync with Adam do not learn; with Zhang et al.'s lr / tau
    (``async:inverse``, ``softsync:4:inverse``) they train."""
    strategies = "async,async:inverse,softsync:4,softsync:4:inverse"
    flags = ["--workers", "64", "--strategies", strategies, "--steps", "8"]
    runs = _run(tmp_path, *flags, "--target", "0.5")
    for plain in ("async", "softsync:4"):
        aware = runs[f"{plain}:inverse"]
        assert runs[plain]["final"] < 0.2, plain
        assert not aware["diverged"] and aware["final"] > 0.6, plain
        assert "Zhang et al." in aware["description"]


def test_several_workers_a_device_compare_as_one_each(tmp_path):
    """--devices 4 --workers 8: the run of 8 devices (the same workload, events and
    updates), each strategy priced as 8 workers (its collectives' and the server's), the
    header naming the workers."""
    flags = ["--strategies", "sync,local:4,gossip,topk:0.1,noloco:4,async,softsync:4",
             "--steps", "8", "--target", "0.3"]  # fmt: skip
    one_each = _run(tmp_path / "one", "--devices", "8", *flags)
    several = _run(tmp_path / "two", "--devices", "4", "--workers", "8", *flags)
    for name, run in several.items():
        theirs = one_each[name]
        np.testing.assert_allclose(run["eval_values"], theirs["eval_values"], rtol=1e-6)
        for key in ("steps_to_target", "events", "comm_bytes_per_event", "comm_s_per_event",
                    "comm_bytes_per_step", "comm_s_per_step"):  # fmt: skip
            assert run[key] == pytest.approx(theirs[key]), (name, key)
        # a worker's compute: the same strategy's program with one worker a device (on 4
        # devices: top-k sums 4 workers' values, not 8)
        assert run["compute_ms_per_step"] == pytest.approx(theirs["compute_ms_per_step"], rel=0.1)
    table = (tmp_path / "two" / "results.md").read_text()
    assert "8 workers on 4 cpu devices" in table and "| bytes / worker / step |" in table


def test_many_workers_draw_more_rows_than_examples():
    from ddl_jax.compare import make_workload

    workload = make_workload("digits-mlp", seed=0, devices=128)  # 16 rows each: 2,048
    first, again = next(workload.batches(0)), next(workload.batches(0))
    assert first["label"].shape == (2048,) == (workload.batch_size,)
    np.testing.assert_array_equal(first["image"], again["image"])  # a seeded stream


def _bundled_params():
    from ddl_jax.compare import make_workload

    return make_workload("digits-mlp", seed=0, devices=DEVICES).params


def test_ties_share_a_rank():
    def run(low, high):
        return {"simulated_seconds_before_target": low, "simulated_seconds_to_target": high}

    runs = [run(0.0, 1.0), run(0.9, 1.2), run(1.1, 2.0), {"simulated_seconds_to_target": None}]
    assert run_module.ranks(runs) == [1, 1, 2, None]
    assert run_module.ranks([{"strategy": "x", "error": "boom"}]) == [None]


def test_a_failing_strategy_leaves_the_others_written(tmp_path, capsys, monkeypatch):
    real = run_module.run_one

    def flaky(spec, *args):
        if spec.text == "local:4":
            raise RuntimeError("out of memory")
        return real(spec, *args)

    monkeypatch.setattr(run_module, "run_one", flaky)
    args = ["compare", "--out", str(tmp_path), "--strategies", "sync,local:4", "--steps", "4"]
    assert cli.main(args) == 1
    runs = {r["strategy"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert runs["local:4"] == {
        "strategy": "local:4",
        "error": "RuntimeError: out of memory",
        "rank": None,
    }
    assert runs["sync"]["final"] > 0
    assert (
        "| - | local:4 | failed: RuntimeError: out of memory |"
        in (tmp_path / "results.md").read_text()
    )
    err = capsys.readouterr().err
    assert "local:4: failed: RuntimeError: out of memory" in err
    assert err.endswith("ddl-jax compare: 1 of 2 strategies failed: local:4.\n"), err


def test_an_out_folder_that_cannot_be_written_is_refused_before_training(capsys, tmp_path):
    assert cli.main(["compare", "--steps", "2", "--out", "/proc/ddl-jax-out"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "out '/proc/ddl-jax-out' cannot be written" in err, err
    (tmp_path / "file").write_text("")
    args = ["compare", "--steps", "2", "--out", str(tmp_path), "--tensorboard"]
    assert cli.main([*args, str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"tensorboard '{tmp_path}/file' cannot be written" in err


def test_an_interrupted_comparison_writes_what_finished(tmp_path, monkeypatch, capsys):
    real = run_module.run_one

    def interrupted(spec, *args):
        if spec.text == "local:4":
            raise KeyboardInterrupt  # Ctrl-C while it trains
        return real(spec, *args)

    monkeypatch.setattr(run_module, "run_one", interrupted)
    args = ["--strategies", "sync,local:4,diloco:4", "--steps", "4", "--out", str(tmp_path)]
    assert cli.main(["compare", *args]) == 130
    assert capsys.readouterr().err.endswith("ddl-jax compare: interrupted.\n")
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert runs[0]["final"] > 0 and [r.get("error") for r in runs[1:]] == ["interrupted"] * 2


def test_a_data_dependent_loop_in_the_compute_is_noted(tmp_path, capsys):
    """DGC's threshold search (top-k's sampled threshold) loops until enough entries pass:
    its compute counts one trip, and the run says so."""
    _run(tmp_path, "--strategies", "sync,topk:0.01", "--steps", "2")
    out = capsys.readouterr().out
    assert "topk:0.01: note: 2 data-dependent loop(s) of its step counted once" in out
    assert "sync: note" not in out
