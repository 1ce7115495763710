"""The private-names contract type that `make test` checks with import-linter
(pyproject.toml's [tool.importlinter]): it finds each way a module can use another
module's private name."""

import textwrap
from pathlib import Path

from tools.import_contracts import violations

MODULES = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"}


def check(source: str, module: str = "pkg.b", tmp_path: Path = Path()) -> list[str]:
    path = tmp_path / "module.py"
    path.write_text(textwrap.dedent(source))
    return violations(module, path, MODULES)


def test_names_imported_or_read_from_another_module_are_found(tmp_path):
    found = check(
        """
        from pkg.a import public, _private
        from pkg import a
        from pkg.sub import c as see
        import pkg.sub.c as other
        x = a._hidden + see._also + other._too + a.public + a.__name__
        """,
        tmp_path=tmp_path,
    )
    assert sorted(found) == [
        "pkg.b:2 uses _private of pkg.a",
        "pkg.b:6 uses _also of pkg.sub.c",
        "pkg.b:6 uses _hidden of pkg.a",
        "pkg.b:6 uses _too of pkg.sub.c",
    ]


def test_relative_imports_are_resolved_and_dunders_and_outside_names_allowed(tmp_path):
    assert check("from .a import _f\n", tmp_path=tmp_path) == ["pkg.b:1 uses _f of pkg.a"]
    assert check("from ..a import _f\n", "pkg.sub.c", tmp_path) == ["pkg.sub.c:1 uses _f of pkg.a"]
    assert check("from pkg.a import __version__\nfrom os import _exit\n", tmp_path=tmp_path) == []
