"""The test suite's timings: what `scripts/test.sh` prints at its end, the result files kept in
benchmarks/results/, and the tables of docs/testing.md generated from them.

    python scripts/test_report.py summary DIR            # each pass's wall time, the 15 slowest tests
    python scripts/test_report.py record DIR OUT.json LABEL   # DIR's passes as one committed result file
    python scripts/test_report.py tables                  # docs/testing.md's tables from benchmarks/results/tests-*.json

DIR holds what one run of scripts/test.sh left in .test-results/: `<pass>.xml` (pytest's JUnit XML, time =
setup + call + teardown of each test) and `<pass>.wall` (the pass's wall seconds, pytest's start included).
Standard library only: it runs before and without the venv.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "testing.md"
RESULTS = ROOT / "benchmarks" / "results"
PASS_ORDER = ("install", "main", "one-thread", "install-oldest", "oldest")


def _tests(xml: Path) -> list[dict]:
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        path = cls.split(".")
        # classname "tests.test_x" or "tests.test_x.TestClass": the file is the first test_* part
        idx = next((i for i, p in enumerate(path) if p.startswith("test_")), len(path) - 1)
        file = "/".join(path[: idx + 1]) + ".py"
        node = "::".join([file, *path[idx + 1 :], name])
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        out.append({"id": node, "file": file, "s": round(float(case.get("time", 0) or 0), 3), "outcome": outcome})
    return out


def _passes(folder: Path) -> list[dict]:
    names = {p.stem for p in folder.glob("*.wall")} | {p.stem for p in folder.glob("*.xml")}
    rank = {n: i for i, n in enumerate(PASS_ORDER)}
    out = []
    for name in sorted(names, key=lambda n: (rank.get(n, 99), n)):
        wall = folder / f"{name}.wall"
        xml = folder / f"{name}.xml"
        out.append(
            {
                "name": name,
                "wall_s": float(wall.read_text().split()[0]) if wall.exists() else None,
                "tests": _tests(xml) if xml.exists() else [],
            }
        )
    return out


def _counts(tests: list[dict]) -> str:
    c: dict[str, int] = defaultdict(int)
    for t in tests:
        c[t["outcome"]] += 1
    return ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "skipped") if c[k])


def summary(folder: Path) -> None:
    passes = _passes(folder)
    print("== the suite's timings (scripts/test_report.py summary .test-results)")
    total = 0.0
    for p in passes:
        wall = p["wall_s"]
        total += wall or 0
        shown = f"{wall:7.1f} s" if wall is not None else "      ? s"
        print(f"  {p['name']:<15} {shown}  {_counts(p['tests'])}")
    print(f"  {'all':<15} {total:7.1f} s")
    everything = [(t["s"], p["name"], t["id"]) for p in passes for t in p["tests"]]
    print("  15 slowest tests (setup + call + teardown):")
    for s, name, node in sorted(everything, reverse=True)[:15]:
        print(f"  {s:7.1f} s  [{name}] {node}")


def record(folder: Path, out: Path, label: str, command: str) -> None:
    data = {"label": label, "command": command, "passes": _passes(folder)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")


def _table(data: dict) -> str:
    lines = [f"Command: `{data['command']}`", ""]
    lines += ["| pass | wall | tests | sum of test times |", "|---|---:|---|---:|"]
    total = 0.0
    for p in data["passes"]:
        wall = p["wall_s"] or 0.0
        total += wall
        summed = sum(t["s"] for t in p["tests"])
        lines.append(f"| {p['name']} | {wall:.0f} s | {_counts(p['tests']) or '-'} | {summed:.0f} s |")
    lines.append(f"| **all** | **{total:.0f} s ({total / 60:.1f} min)** | | |")
    lines += ["", "Per file (summed test times, every pass):", "", "| file | tests | seconds |", "|---|---:|---:|"]
    per_file: dict[str, list[float]] = defaultdict(list)
    for p in data["passes"]:
        for t in p["tests"]:
            per_file[f"{t['file']} ({p['name']})" if p["name"] != "main" else t["file"]].append(t["s"])
    for f, times in sorted(per_file.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {f} | {len(times)} | {sum(times):.1f} |")
    lines += ["", "The 30 slowest tests:", "", "| seconds | pass | test |", "|---:|---|---|"]
    everything = [(t["s"], p["name"], t["id"]) for p in data["passes"] for t in p["tests"]]
    for s, name, node in sorted(everything, reverse=True)[:30]:
        lines.append(f"| {s:.1f} | {name} | `{node}` |")
    return "\n".join(lines)


def tables() -> None:
    text = DOC.read_text()
    for result in sorted(RESULTS.glob("tests-*.json")):
        data = json.loads(result.read_text())
        key = result.stem
        begin, end = f"<!-- {key}: begin (scripts/test_report.py tables) -->", f"<!-- {key}: end -->"
        block = f"{begin}\n{_table(data)}\n{end}"
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
        if pattern.search(text):
            text = pattern.sub(lambda _, block=block: block, text)
        else:
            print(f"docs/testing.md has no place for {key} (add the two markers)", file=sys.stderr)
    DOC.write_text(text)


def main(argv: list[str]) -> int:
    if argv[:1] == ["summary"] and len(argv) == 2:
        summary(Path(argv[1]))
    elif argv[:1] == ["record"] and len(argv) in (4, 5):
        record(Path(argv[1]), Path(argv[2]), argv[3], argv[4] if len(argv) == 5 else "bash .ci/run")
    elif argv == ["tables"]:
        tables()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
