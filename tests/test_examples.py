"""The examples run as a user runs them, in a fresh process."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_reaches_95_percent_test_accuracy_on_8_devices():
    out = subprocess.run(
        [sys.executable, "examples/quickstart.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    devices, accuracy = re.search(r"(\d+) devices, test accuracy ([\d.]+)", out).groups()
    assert int(devices) == 8
    assert float(accuracy) >= 0.95


def test_multihost_example_trains_on_two_launched_processes():
    launcher = Path(sys.executable).parent / "ddl-jax"
    out = subprocess.run(
        [
            str(launcher),
            "launch",
            "-n",
            "2",
            "--devices-per-process",
            "2",
            "--",
            sys.executable,
            "examples/multihost.py",
            "--steps",
            "100",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    processes, devices, accuracy = re.search(
        r"\[rank 0\] (\d+) process\(es\), (\d+) devices: step 100, test accuracy ([\d.]+)", out
    ).groups()
    assert (int(processes), int(devices)) == (2, 4)
    assert float(accuracy) >= 0.9
