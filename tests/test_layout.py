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
