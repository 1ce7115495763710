"""The examples run as a user runs them, in a fresh process."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*command: str) -> str:
    """The command's standard output; it must succeed within 10 minutes."""
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
    ).stdout


def test_quickstart_reaches_95_percent_test_accuracy_on_8_devices():
    out = run(sys.executable, "examples/quickstart.py")
    devices, accuracy = re.search(r"(\d+) devices, test accuracy ([\d.]+)", out).groups()
    assert int(devices) == 8
    assert float(accuracy) >= 0.95


def test_multihost_example_trains_on_two_launched_processes(tmp_path):
    launcher = Path(sys.executable).parent / "ddl-jax"
    command = ["launch", "-n", "2", "--devices-per-process", "2", "--", sys.executable]
    example = ["examples/multihost.py", "--steps", "100", "--checkpoint-dir", str(tmp_path)]
    line = r"\[rank 0\] (\d+) process\(es\), (\d+) devices: step 100, test accuracy ([\d.]+)"
    processes, devices, accuracy = re.search(line, run(str(launcher), *command, *example)).groups()
    assert (int(processes), int(devices)) == (2, 4)
    assert float(accuracy) >= 0.9
    # Run again: it resumes at its last step, trains nothing, and says where it is.
    again = run(str(launcher), *command, *example)
    assert "resumed at step 100 of 100" in again
    assert re.search(line, again).groups() == (processes, devices, accuracy)


def test_the_readme_quickstart_runs_as_written():
    """Every name the README's quickstart uses is defined in it (a shorter run here)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quickstart") :]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert "steps=400" in code
    namespace: dict = {}
    exec(compile(code.replace("steps=400", "steps=5"), "README.md", "exec"), namespace)
    assert [r["step"] for r in namespace["history"]] == [1, 2, 3, 4, 5]
