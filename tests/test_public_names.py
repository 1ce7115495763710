"""Every public function and class of ddl_jax says what it is, and the README's API table
names only arguments they take."""

import inspect
import re
from pathlib import Path

import pytest

import ddl_jax as ddl

NAMESPACES = [ddl] + [
    getattr(ddl, name) for name in ddl.__all__ if inspect.ismodule(getattr(ddl, name))
]
PUBLIC = sorted(
    {
        (f"{module.__name__}.{name}", getattr(module, name))
        for module in NAMESPACES
        for name in module.__all__
        if inspect.isfunction(getattr(module, name)) or inspect.isclass(getattr(module, name))
    },
    key=lambda pair: pair[0],
)


def test_every_namespace_has_a_docstring_and_declares_its_public_names():
    assert all(module.__doc__ and hasattr(module, "__all__") for module in NAMESPACES)
    assert len(PUBLIC) > 50


@pytest.mark.parametrize(("name", "value"), PUBLIC, ids=[name for name, _ in PUBLIC])
def test_every_public_name_has_a_docstring(name, value):
    doc = (value.__doc__ or "").strip()
    # A NamedTuple without a docstring gets "Name(field, ...)" from Python: not one.
    assert doc and not doc.startswith(f"{value.__name__}("), f"{name} has no docstring"


def _api_rows() -> list[tuple[str, list[str]]]:
    """The README's API table: each ``ddl.name(arguments)`` it shows, with the names of
    the arguments it gives."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    shown = []
    for row in readme.splitlines():
        if not row.startswith("| `ddl."):
            continue
        for match in re.finditer(r"`(ddl(?:\.\w+)+)\((.*?)\)`", row.split(" | ")[0]):
            names = [a.split("=")[0].strip().lstrip("*") for a in _top_level(match[2])]
            shown.append((match[1], [n for n in names if re.fullmatch(r"\w+", n)]))
    return shown


def _top_level(arguments: str) -> list[str]:
    """``arguments`` split at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for ch in arguments:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts, current = [*parts, current], ""
        else:
            current += ch
    return [*parts, current]


@pytest.mark.parametrize(("name", "arguments"), _api_rows(), ids=[n for n, _ in _api_rows()])
def test_the_readmes_api_table_names_only_real_arguments(name, arguments):
    value = ddl
    for part in name.split(".")[1:]:
        value = getattr(value, part)
    parameters = inspect.signature(value).parameters
    assert [a for a in arguments if a not in parameters] == [], f"{name}: {list(parameters)}"
