"""The house rules a reader relies on: every module of the package opens with a statement of its job, and
none is over 400 lines (a longer one is split by theme before it grows further)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dali_fast"
MOST_LINES = 400


def test_every_module_opens_with_its_job_and_stays_within_400_lines():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if len(text.splitlines()) > MOST_LINES:
            problems.append(f"{name}: {len(text.splitlines())} lines")
        if not ast.get_docstring(ast.parse(text)):
            problems.append(f"{name}: no module docstring")
    assert not problems, problems


def test_every_module_is_named_in_its_package_s_map():
    """Each package's docstring maps its files: a new module is named there, quoted, so a reader finds it
    from the package (```name```, ```name.py``` or, for a sub-package, ```name/```)."""
    import re

    missing = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent
        text = ast.get_docstring(ast.parse(init.read_text())) or ""
        words = set(re.findall(r"`{1,2}([A-Za-z_][A-Za-z0-9_]*)(?:\.py|/)?`{1,2}", text))
        for entry in sorted(folder.iterdir()):
            name = entry.stem if entry.suffix == ".py" else entry.name
            is_module = entry.suffix == ".py" and entry.name != "__init__.py"
            is_package = entry.is_dir() and (entry / "__init__.py").exists()
            if (is_module or is_package) and name not in words:
                missing.append(f"{entry.relative_to(PACKAGE.parent)} is not named in {init.relative_to(PACKAGE.parent)}")
    assert not missing, missing
