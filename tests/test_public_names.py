"""Every public function and class of ddl_jax says what it is."""

import inspect

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
