"""The ``>>>`` examples in the package's docstrings run, on conftest's 8 CPU devices.

Every module of ``ddl_jax`` (``ddl_jax._src`` included) whose source holds a ``>>>``
example is found from the files, so an example added anywhere is tested without touching
this file. Examples import what they use (``import ddl_jax as ddl``, ...), as a reader
would.
"""

import contextlib
import doctest
import importlib
import io
import pathlib

import pytest

import ddl_jax

PACKAGE = pathlib.Path(ddl_jax.__file__).parent
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def modules_with_examples() -> list[str]:
    """Dotted names of the package's modules whose source holds a ``>>>`` example."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" in path.read_text(encoding="utf-8"):
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = modules_with_examples()


def test_the_examples_are_found():
    # Discovery must not come back empty: these modules have examples.
    expected = {"reduce.allreduce", "reduce.quantise", "reduce.sparse", "reduce.lowrank"}
    expected |= {"reduce.collectives", "measure.comm", "core.mesh", "data.datasets"}
    assert {f"ddl_jax._src.{m}" for m in expected} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        failed, attempted = doctest.testmod(module, optionflags=FLAGS, report=True)
    assert attempted > 0, f"{name} has '>>>' in its source but no example doctest can find"
    assert failed == 0, report.getvalue()
