"""The public surface: every name in ``dali_fast.__all__`` resolves, the documented import paths import,
and ``import dali_fast`` stays cheap."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import dali_fast

# Import paths the documentation shows (module, name).
DOCUMENTED = [
    ("dali_fast.lightning", "DaliFastDataModule"),
    ("dali_fast.transforms.recipe", "Recipe"),
    ("dali_fast.transforms.mix", "MixupCutmix"),
    ("dali_fast.transforms.mix", "soft_target_cross_entropy"),
    ("dali_fast.data.open", "open_dataset"),
    ("dali_fast.data.pack.packed", "pack"),
    ("dali_fast.loaders.factory", "make_loader"),
]


def test_all_is_sorted_and_every_name_resolves():
    assert dali_fast.__all__ == sorted(dali_fast.__all__)
    assert len(set(dali_fast.__all__)) == len(dali_fast.__all__)
    for name in dali_fast.__all__:
        value = getattr(dali_fast, name)
        assert getattr(value, "__name__", name) == name, f"dali_fast.{name} is {value!r}"


def test_star_import_gives_exactly_all():
    namespace: dict = {}
    exec("from dali_fast import *", namespace)
    assert sorted(k for k in namespace if not k.startswith("__")) == dali_fast.__all__


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        dali_fast.nothing_here  # noqa: B018


@pytest.mark.parametrize(("module", "name"), DOCUMENTED, ids=[f"{m}.{n}" for m, n in DOCUMENTED])
def test_documented_import_paths(module, name):
    if module == "dali_fast.lightning":
        pytest.importorskip("pytorch_lightning")
    value = getattr(importlib.import_module(module), name)
    if name in dali_fast.__all__:
        assert value is getattr(dali_fast, name)


def test_import_is_cheap():
    code = "import sys, dali_fast; print(sorted(m for m in ('torch', 'nvidia.dali', 'PIL') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_data_wing_imports_no_torch():
    """Formats and readers are numpy only: a data tool or a DataLoader worker reading records pays for no torch."""
    modules = sorted(p.stem for p in Path(dali_fast.__file__).parent.joinpath("data").glob("*.py"))
    code = f"import sys\nfor m in {modules!r}: __import__('dali_fast.data.' + m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_public_callable_names_each_parameter_under_args_or_attributes():
    """mkdocstrings renders a Google-style ``Args:`` (functions, classes) or ``Attributes:`` (dataclasses)
    section as the parameter table; a public name whose parameter is missing there is documented in prose
    at best. Exceptions take the built-in ``*args``."""
    import inspect
    import re

    import dali_fast

    missing = []
    for name in dali_fast.__all__:
        obj = getattr(dali_fast, name)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)) or (
            inspect.isclass(obj) and issubclass(obj, BaseException)
        ):
            continue
        doc = inspect.getdoc(obj) or ""
        section = re.split(r"^(?:Args|Attributes):$", doc, maxsplit=1, flags=re.M)
        params = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj).parameters
        for param in params:
            if param != "self" and (len(section) < 2 or not re.search(rf"^\s+\**{param}:", section[1], re.M)):
                missing.append(f"{name}: {param}")
    assert not missing, missing
