"""import-linter contract types of this project (``[tool.importlinter]`` in pyproject.toml).

``private_names``: no module of the root package uses another module's private name
(one with a leading underscore, not a dunder), whether imported by name
(``from m import _f``) or read from an imported module (``m._f``). What modules share
they say in public names; tests, outside the package, may look inside.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from importlinter import Contract, ContractCheck, fields, output


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _path(module: str, root: Path) -> Path:
    parts = module.split(".")[1:]
    package = root.joinpath(*parts, "__init__.py")
    return package if package.exists() else root.joinpath(*parts).with_suffix(".py")


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, node.module] if node.module else base)


def violations(module: str, path: Path, modules: set[str]) -> list[str]:
    """Each use in ``module`` (source at ``path``) of a private name of another module
    among ``modules``, as ``"module:line uses name of other"``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path.name == "__init__.py")
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                elif source in modules and source != module and _private(alias.name):
                    found.append(f"{module}:{node.lineno} uses {alias.name} of {source}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private(node.attr)
        ):
            found.append(f"{module}:{node.lineno} uses {node.attr} of {aliases[node.value.id]}")
    return found


class PrivateNamesContract(Contract):
    """Modules of ``root`` use no private name of another module.

    Options:
      root: the package whose modules are checked (its modules only).
    """

    root = fields.StringField()

    def check(self, graph, verbose: bool) -> ContractCheck:
        spec = importlib.util.find_spec(str(self.root))
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"private_names: no package {self.root!r} on sys.path.")
        root = Path(next(iter(spec.submodule_search_locations)))
        modules = {m for m in graph.modules if m.split(".")[0] == str(self.root)}
        found = [v for m in sorted(modules) for v in violations(m, _path(m, root), modules)]
        return ContractCheck(kept=not found, metadata={"violations": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for line in check.metadata["violations"]:
            output.print_error(line, bold=False)
        output.new_line()
