"""Summarize a `mutmut run` (what `make mutate` runs) per module, into build/mutation/.

Reads every mutant's status from `mutmut results --all true`, and the mutants that cannot change
behaviour from tests/equivalent_mutants.txt (one per line: the mutant's name, then why). Writes
report.md (a table per module and the diff of each survivor) and report.json; exits 1 when a
mutant survived that is not listed as equivalent, or a listed one no longer exists or is killed by a
test (mutmut renumbers a function's mutants when it changes, so a listed name can come to mean another
mutant: its line must then go, or name the equivalent under its new number).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT = ROOT / "tests" / "equivalent_mutants.txt"


def mutmut(*args: str) -> str:
    exe = Path(sys.executable).with_name("mutmut")
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def equivalents() -> dict[str, str]:
    out = {}
    for line in EQUIVALENT.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, why = line.strip().partition(" ")
            out[name] = why.strip()
    return out


def module_of(name: str) -> str:
    return name.split(".x")[0] if ".x" in name else name.rsplit(".", 1)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "mutation"))
    args = ap.parse_args()
    statuses = {}
    for line in mutmut("results", "--all", "true").splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            statuses[name] = status
    if not statuses:
        print("no mutmut results: run `mutmut run` first", file=sys.stderr)
        return 2
    equiv = equivalents()
    per: dict[str, Counter] = defaultdict(Counter)
    survivors: list[str] = []
    for name, status in sorted(statuses.items()):
        mod = module_of(name)
        per[mod]["generated"] += 1
        if status == "survived" and name in equiv:
            per[mod]["equivalent"] += 1
        else:
            per[mod][status] += 1
            if status not in ("killed", "timeout", "segfault", "not checked"):
                survivors.append(name)
    stale = sorted(set(equiv) - set(statuses))
    # A listed mutant that timed out stays listed: on a busy machine an equivalent one can run past the limit.
    killed_listed = sorted(n for n in equiv if statuses.get(n) == "killed")
    rows = []
    total = Counter()
    for mod in sorted(per):
        c = per[mod]
        total.update(c)
        rows.append((mod, c))
    rows.append(("all", total))
    lines = [
        "# Mutation testing (mutmut)",
        "",
        "| module | generated | killed | timeout | crashed | survived | no tests | equivalent | not run | killed % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    table = {}
    for mod, c in rows:
        judged = c["generated"] - c["equivalent"] - c["not checked"]
        score = (c["killed"] + c["timeout"] + c["segfault"]) / judged if judged else 1.0
        table[mod] = {**c, "score": score}
        lines.append(
            f"| {mod} | {c['generated']} | {c['killed']} | {c['timeout']} | {c['segfault']} | {c['survived']} | "
            f"{c['no tests']} | {c['equivalent']} | {c['not checked']} | {score:.1%} |"
        )
    lines += [
        "",
        "`killed %` = (killed + timeout + crashed) / (generated - equivalent - not run); `crashed`: a test process"
        " died of a signal under the mutant (its tests did not pass); `not run`: the run was stopped first.",
        "",
    ]
    if equiv:
        lines += ["## Equivalent mutants (cannot change behaviour)", ""]
        lines += [f"- `{n}`: {w}" for n, w in sorted(equiv.items()) if n in statuses]
        lines.append("")
    if survivors:
        lines += ["## Survivors", ""]
        for name in survivors:
            lines += [f"### `{name}` ({statuses[name]})", "", "```diff", mutmut("show", name).strip(), "```", ""]
    if stale:
        lines += ["## Listed as equivalent but no longer generated", ""] + [f"- `{n}`" for n in stale]
    if killed_listed:
        lines += ["", "## Listed as equivalent but killed by a test", ""] + [f"- `{n}`" for n in killed_listed]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    report = {"modules": table, "survivors": survivors, "stale": stale, "killed_listed": killed_listed}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print("\n".join(lines[: len(rows) + 4]))
    print(
        f"\n{len(survivors)} survivors, {len(stale)} listed names no longer generated, {len(killed_listed)} listed "
        f"names killed; wrote {out / 'report.md'}"
    )
    return 1 if survivors or stale or killed_listed else 0


if __name__ == "__main__":
    sys.exit(main())
