"""scripts/mutation_report.py: what `make mutate` reports and when it fails, from mutmut's results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def report(tmp_path, monkeypatch):
    """The script as a module, reading ``results`` (name -> status) and the equivalents written to a file."""
    spec = importlib.util.spec_from_file_location("mutation_report", ROOT / "scripts" / "mutation_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run(results: dict[str, str], listed: dict[str, str]) -> tuple[int, dict]:
        equivalent = tmp_path / "equivalent_mutants.txt"
        equivalent.write_text("# why each\n" + "".join(f"{n} {w}\n" for n, w in listed.items()))
        monkeypatch.setattr(module, "EQUIVALENT", equivalent)

        def mutmut(*args):
            if args[0] == "show":
                return f"--- {args[1]}\n+++ mutated"
            return "".join(f"    {name}: {status}\n" for name, status in results.items())

        monkeypatch.setattr(module, "mutmut", mutmut)
        monkeypatch.setattr("sys.argv", ["mutation_report.py", "--out", str(tmp_path / "out")])
        code = module.main()
        return code, json.loads((tmp_path / "out" / "report.json").read_text())

    return run


def test_listed_survivors_pass_and_an_unlisted_one_fails(report):
    results = {"m.x_f__mutmut_1": "killed", "m.x_f__mutmut_2": "survived", "m.x_g__mutmut_1": "timeout"}
    code, got = report(results, {"m.x_f__mutmut_2": "the same call"})
    assert code == 0 and got["survivors"] == [] and got["modules"]["m"]["equivalent"] == 1
    assert got["modules"]["m"]["score"] == 1.0
    code, got = report({**results, "m.x_g__mutmut_2": "survived"}, {"m.x_f__mutmut_2": "the same call"})
    assert code == 1 and got["survivors"] == ["m.x_g__mutmut_2"]


def test_a_listed_name_that_is_gone_or_killed_fails_the_report(report):
    """mutmut renumbers a function's mutants when it changes: a listed name may then be gone or mean a
    mutant a test kills; either way its line is wrong."""
    results = {"m.x_f__mutmut_1": "killed", "m.x_f__mutmut_2": "survived"}
    code, got = report(results, {"m.x_f__mutmut_2": "why", "m.x_f__mutmut_9": "why"})
    assert code == 1 and got["stale"] == ["m.x_f__mutmut_9"] and got["killed_listed"] == []
    code, got = report(results, {"m.x_f__mutmut_2": "why", "m.x_f__mutmut_1": "why"})
    assert code == 1 and got["stale"] == [] and got["killed_listed"] == ["m.x_f__mutmut_1"]
    slow = {**results, "m.x_f__mutmut_1": "timeout"}  # an equivalent mutant past the limit on a busy machine
    code, got = report(slow, {"m.x_f__mutmut_2": "why", "m.x_f__mutmut_1": "why"})
    assert code == 0 and got["killed_listed"] == [] and got["modules"]["m"]["timeout"] == 1


def test_a_mutant_whose_tests_crashed_counts_as_caught_and_no_tests_as_a_survivor(report):
    """A test process killed by a signal under a mutant ("segfault") did not pass: the mutant is caught.
    A mutant no test runs ("no tests") is a gap, reported like a survivor."""
    results = {"m.x_f__mutmut_1": "segfault", "m.x_f__mutmut_2": "killed"}
    code, got = report(results, {})
    assert code == 0 and got["survivors"] == [] and got["modules"]["m"]["score"] == 1.0
    assert got["modules"]["m"]["segfault"] == 1
    code, got = report({**results, "m.x_g__mutmut_1": "no tests"}, {})
    assert code == 1 and got["survivors"] == ["m.x_g__mutmut_1"]
