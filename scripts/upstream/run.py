"""Run Lightning's, Accelerate's and DeepSpeed's own checkpoint tests stock and with lazyckpt injected; print them
side by side.

    python scripts/upstream/run.py [--suites accelerate lightning fabric deepspeed] [--timeout 120] [--out DIR]
        [--lightning-src PATH]   # a checkout holding tests/ (env LAZYCKPT_LIGHTNING_SRC); fetched, never shipped
        [--accelerate-src PATH]  # default: the sdist of the installed Accelerate, downloaded into DIR
        [--deepspeed-src PATH]   # DeepSpeed's tests/ at the installed version's tag (env LAZYCKPT_DEEPSPEED_SRC)

Modes run one after another (no -x, no xdist, -p no:cacheprovider). Each test has a per-test timeout
(pytest-timeout, signal method: a hang fails that test as "hung" and the run goes on); a run the timeout cannot
break (no new outcome for --timeout + --stuck-after s) is killed, the running test counted as hung, and the run resumed
without the tests already recorded. Per-test outcomes go to DIR/<suite>-<mode>.jsonl so modes can be diffed test
by test; DIR/summary.md holds the table and the differences from the control (Lightning: its own
AsyncCheckpointIO; Accelerate: stock). Exit status 0 whatever the tests do: this is a measurement; 2 when a
suite and mode ran no test at all (it did not collect: e.g. Accelerate's tests import ``parameterized``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "tests"))
from _launch import release_shm  # noqa: E402 - the tests' launcher, stdlib only

OUTCOMES = ("passed", "failed", "error", "hung", "skipped", "xfailed", "xpassed")


@dataclass(frozen=True)
class Suite:
    name: str
    plugin: str  # the injecting pytest plugin (a module in this folder)
    modes: tuple[str, ...]
    control: str  # the mode lazyckpt is held to
    paths: tuple[str, ...]  # test paths relative to the suite's working directory (globs allowed)
    keyword: str | None = None  # pytest -k
    ignore: tuple[str, ...] = ()  # paths left out


ACCELERATE = Suite(
    "accelerate",
    "lazyckpt_upstream_accelerate",
    ("stock", "lazy"),
    "stock",
    ("tests/test_state_checkpointing.py", "tests/test_accelerator.py"),  # whole files: 73 tests, ~1 min
)
LIGHTNING = Suite(
    "lightning",
    "lazyckpt_upstream_lightning",
    ("stock", "lazy", "async"),
    "async",
    (
        "tests_pytorch/checkpointing",
        "tests_pytorch/trainer/connectors/test_checkpoint_connector.py",
        "tests_pytorch/models/test_restore.py",
        # fits that fail, are interrupted or end early (exception checkpoints, logger finalize, thread
        # checks: issue 39), tuners that save and restore, callbacks that swap weights or read files
        "tests_pytorch/loops",
        "tests_pytorch/tuner",
        "tests_pytorch/callbacks",
    ),
    # 345 loads of downloaded checkpoints of old releases: nothing a CheckpointIO plugin saves
    ignore=("tests_pytorch/checkpointing/test_legacy_checkpoints.py",),
)
FABRIC = Suite(
    "fabric",
    "lazyckpt_upstream_lightning",
    ("stock", "lazy", "async"),
    "async",
    ("tests_fabric/test_fabric.py",),
    "test_save or test_load or fabric_load",
)
# DeepSpeed's checkpoint unit tests that run on CPU (DS_ACCELERATOR=cpu, LOCAL_SIZE=2: two CPU "devices"); the
# universal-checkpoint (144), AutoTP and pipeline files need more ranks or a GPU and are left out.
DEEPSPEED = Suite(
    "deepspeed",
    "lazyckpt_upstream_deepspeed",
    ("stock", "lazy"),
    "stock",
    tuple(
        f"unit/checkpoint/test_{name}.py"
        for name in (
            "latest_checkpoint",
            "tag_validation",
            "zero_optimizer",
            "lr_scheduler",
            "other_optimizer",
            "shared_weights",
            "sparse",
            "convert_checkpoint",
            "moe_checkpoint",
            "reshape_checkpoint",
        )
    ),  # fmt: skip
)
SUITES = {s.name: s for s in (ACCELERATE, LIGHTNING, FABRIC, DEEPSPEED)}


def log(msg: str) -> None:
    print(f"[upstream {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- sources ---------------------------------------------------------------------------------------


def accelerate_source(out: Path, given: str | None) -> Path:
    """The folder holding Accelerate's tests/: given, or the installed version's sdist (it ships tests/)."""
    if given:
        return Path(given)
    import accelerate

    version = accelerate.__version__
    root = out / f"accelerate-{version}"
    if not (root / "tests").is_dir():
        dl = out / "dl"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*cmd, f"accelerate=={version}", "-d", str(dl)], check=True)
        (sdist,) = dl.glob(f"accelerate-{version}.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(out, filter="data")
    return root


def lightning_tests(given: str | None) -> Path:
    src = given or os.environ.get("LAZYCKPT_LIGHTNING_SRC")
    if not src:
        raise SystemExit(
            "Lightning's sdist ships no tests: check the repository out at the installed tag and pass its path "
            "(--lightning-src or LAZYCKPT_LIGHTNING_SRC), e.g. "
            "`git --git-dir=<clone>/.git archive <tag> tests | tar -x -C <dir>`"
        )
    tests = Path(src) / "tests"
    if not (tests / "tests_pytorch").is_dir():
        raise SystemExit(f"{tests}/tests_pytorch not found: --lightning-src must hold Lightning's tests/")
    return tests


def deepspeed_tests(given: str | None) -> Path:
    src = given or os.environ.get("LAZYCKPT_DEEPSPEED_SRC")
    if not src or not (Path(src) / "tests" / "unit" / "checkpoint").is_dir():
        raise SystemExit(
            "DeepSpeed's tests are not in its wheel: pass a folder holding tests/ at the installed version's tag "
            "(--deepspeed-src or LAZYCKPT_DEEPSPEED_SRC), e.g. `git --git-dir=<clone>/.git archive v0.19.5 tests | "
            "tar -x -C <dir>`; the tests must match the installed DeepSpeed"
        )
    return Path(src) / "tests"


# -- one mode --------------------------------------------------------------------------------------


def read_rows(path: Path) -> tuple[dict[str, dict], list[str]]:
    """Final rows by nodeid, and the nodeids started (in order)."""
    done: dict[str, dict] = {}
    started: list[str] = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if row["event"] == "start":
                started.append(row["nodeid"])
            else:
                done[row["nodeid"]] = row
    return done, started


def pytest_cmd(suite: Suite, cwd: Path, timeout: float, skip: list[str]) -> list[str]:
    paths = [p for pattern in suite.paths for p in sorted(glob.glob(pattern, root_dir=cwd))]
    cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", "-p", "lazyckpt_upstream_record"]
    cmd += ["-p", suite.plugin, f"--timeout={timeout:g}", "--timeout-method=signal", "-o", "addopts="]
    if suite.keyword:
        cmd += ["-k", suite.keyword]
    cmd += [f"--ignore={path}" for path in suite.ignore]
    for nodeid in skip:
        cmd += ["--deselect", nodeid]
    return cmd


def run_mode(
    suite: Suite, mode: str, cwd: Path, out: Path, timeout: float, env_extra: dict[str, str], stuck_after: float = 120.0
) -> dict:
    record = out / f"{suite.name}-{mode}.jsonl"
    record.unlink(missing_ok=True)
    env = dict(os.environ, LAZYCKPT_UPSTREAM_MODE=mode, LAZYCKPT_UPSTREAM_RECORD=str(record), **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    hung_by_kill: dict[str, dict] = {}
    t0 = time.monotonic()
    while True:
        done, started = read_rows(record)
        done.update(hung_by_kill)
        cmd = pytest_cmd(suite, cwd, timeout, sorted(done))
        log(f"{suite.name}/{mode}: pytest in {cwd} ({len(done)} already recorded)")
        with open(out / f"{suite.name}-{mode}.log", "a", encoding="utf-8") as logf:
            proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
            )
            killed = watch(proc, record, timeout + stuck_after)
        if not killed:
            break
        done, started = read_rows(record)
        running = [n for n in started if n not in done and n not in hung_by_kill]
        if not running:
            break  # killed after the last test (teardown or exit hung): nothing left to resume
        hung_by_kill[running[-1]] = {"nodeid": running[-1], "outcome": "hung", "message": "killed: run stopped"}
        log(f"{suite.name}/{mode}: killed a stuck run at {running[-1]}; resuming")
    release_shm()  # DeepSpeed's CPU all-reduce buffers its ended ranks left in /dev/shm
    done, _ = read_rows(record)
    done.update(hung_by_kill)
    log(f"{suite.name}/{mode}: {len(done)} tests in {time.monotonic() - t0:.0f} s")
    return done


def watch(proc: subprocess.Popen, record: Path, quiet_limit: float) -> bool:
    """Wait for pytest; kill its process group when no outcome line came for ``quiet_limit`` s. True if killed."""
    last_size, last_change = -1, time.monotonic()
    while proc.poll() is None:
        size = record.stat().st_size if record.exists() else 0
        if size != last_size:
            last_size, last_change = size, time.monotonic()
        elif time.monotonic() - last_change > quiet_limit:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(2)
    return False


# -- report ----------------------------------------------------------------------------------------


def counts(rows: dict[str, dict]) -> dict[str, int]:
    c = dict.fromkeys(OUTCOMES, 0)
    for row in rows.values():
        c[row["outcome"]] = c.get(row["outcome"], 0) + 1
    return c


def normalise(message: str) -> str:
    """An error's first line with paths, addresses and numbers blurred, to group tests by failure pattern."""
    message = re.sub(r"(/[^\s'\"]+)+", "<path>", message)
    message = re.sub(r"0x[0-9a-f]+", "0x…", message)
    return re.sub(r"\d+(\.\d+)?", "N", message)[:200]


def table(results: dict[str, dict[str, dict[str, dict]]]) -> str:
    lines = ["| suite | mode | tests | " + " | ".join(OUTCOMES) + " |", "|---|---|---|" + "---|" * len(OUTCOMES)]
    for suite_name, by_mode in results.items():
        for mode, rows in by_mode.items():
            c = counts(rows)
            lines.append(f"| {suite_name} | {mode} | {len(rows)} | " + " | ".join(str(c[o]) for o in OUTCOMES) + " |")
    return "\n".join(lines)


def per_file(suite_name: str, by_mode: dict[str, dict[str, dict]]) -> str:
    """Per test file and mode: passed of run, and the seconds its tests took (setup, call and teardown:
    a fixture's wait for leftover threads counts); each mode's time over stock's."""
    files: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))
    for mode, rows in by_mode.items():
        for nodeid, row in rows.items():
            cell = files[nodeid.split("::")[0]][mode]
            cell[0] += row["outcome"] == "passed"
            cell[1] += 1
            cell[2] += row.get("seconds", 0.0)
    modes = list(by_mode)
    head = f"| {suite_name} file | " + " | ".join(f"{m} passed | {m} s" for m in modes)
    ratios = [m for m in modes if m != "stock" and "stock" in modes]
    lines = [
        head + "".join(f" | {m}/stock" for m in ratios) + " |",
        "|---|" + "---|---|" * len(modes) + "---|" * len(ratios),
    ]
    for name in sorted(files):
        cells = files[name]
        row = f"| {name} | " + " | ".join(
            f"{int(cells[m][0])}/{int(cells[m][1])} | {cells[m][2]:.1f}" if m in cells else "- | -" for m in modes
        )
        for m in ratios:
            stock = cells["stock"][2] if "stock" in cells else 0.0
            row += f" | {cells[m][2] / stock:.2f}" if m in cells and stock > 0 else " | -"
        lines.append(row + " |")
    return "\n".join(lines)


def lost_by_lazy(reference: dict[str, dict], lazy: dict[str, dict]) -> dict[tuple[str, str], list[str]]:
    """Tests that pass in ``reference`` but not with lazyckpt, grouped by (outcome, blurred first error line)."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for nodeid, row in reference.items():
        mine = lazy.get(nodeid)
        if row["outcome"] == "passed" and mine is not None and mine["outcome"] != "passed":
            groups[(mine["outcome"], normalise(mine["message"]))].append(nodeid)
    return groups


def differences(suite: Suite, by_mode: dict[str, dict[str, dict]]) -> str:
    """What lazyckpt loses against the control (and against stock), and what the control loses against stock."""
    lazy, stock = by_mode.get("lazy", {}), by_mode.get("stock", {})
    out = []
    references = [suite.control] if suite.control == "stock" else [suite.control, "stock"]
    for label in references:
        groups = lost_by_lazy(by_mode.get(label, {}), lazy)
        out.append(f"\n### {suite.name}: {sum(map(len, groups.values()))} pass with {label} but not with lazy\n")
        for (outcome, _pattern), ids in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            out.append(f"- **{outcome}** ({len(ids)}): `{lazy[ids[0]]['message']}`")
            out.extend(f"    - `{i}`" for i in sorted(ids))
    if suite.control != "stock":
        control = by_mode.get(suite.control, {})
        worse = [n for n, r in stock.items() if r["outcome"] == "passed" and n in control]
        worse = [n for n in worse if control[n]["outcome"] != "passed"]
        out.append(f"\n### {suite.name}: {len(worse)} pass stock but not with {suite.control} (any async plugin)\n")
        out.extend(f"- `{n}` ({control[n]['outcome']}: `{control[n]['message']}`)" for n in sorted(worse))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES))
    ap.add_argument("--modes", nargs="+", help="default: each suite's modes (stock lazy [async])")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-test timeout in seconds")
    ap.add_argument("--stuck-after", type=float, default=120.0, help="kill a run silent for timeout + this (s)")
    ap.add_argument("--out", default="build/upstream")
    ap.add_argument("--lightning-src")
    ap.add_argument("--accelerate-src")
    ap.add_argument("--deepspeed-src")
    ap.add_argument("--paths", nargs="+", help="run only these test paths (globs allowed) instead of the suites' lists")
    ap.add_argument("--report-only", action="store_true", help="no run: the summary of the outcomes already in --out")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict[str, dict]]] = {}
    for name in args.suites:
        suite = SUITES[name] if not args.paths else replace(SUITES[name], paths=tuple(args.paths))
        if name == "accelerate":
            cwd = accelerate_source(out, args.accelerate_src)
            extra = {"PYTHONPATH": os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH", "")) if p)}
        elif name == "deepspeed":
            cwd, extra = deepspeed_tests(args.deepspeed_src), {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2"}
            site = [str(HERE / "deepspeed_site"), os.environ.get("PYTHONPATH", "")]  # sitecustomize: every process
            extra["PYTHONPATH"] = os.pathsep.join(p for p in site if p)
        else:
            cwd, extra = lightning_tests(args.lightning_src), {}
        modes = [m for m in (args.modes or suite.modes) if m in suite.modes]
        if args.report_only:  # (modes run apart, e.g. side by side into one --out)
            results[name] = {m: read_rows(out / f"{name}-{m}.jsonl")[0] for m in modes}
            continue
        results[name] = {m: run_mode(suite, m, cwd, out, args.timeout, extra, args.stuck_after) for m in modes}
    report = [f"## Upstream suites, per-test timeout {args.timeout:g} s\n", table(results)]
    report += [differences(SUITES[n], by_mode) for n, by_mode in results.items()]
    report += ["\n## Per file\n"] + [per_file(n, by_mode) for n, by_mode in results.items()]
    text = "\n".join(report) + "\n"
    (out / "summary.md").write_text(text, encoding="utf-8")
    print(text)
    empty = [f"{n}/{m}" for n, by_mode in results.items() for m, done in by_mode.items() if not done]
    if empty:  # not a measurement: the suite did not collect (a missing test dependency, a wrong --paths)
        print(f"no test ran in {empty}: see {out}/<suite>-<mode>.log (Accelerate's tests need `parameterized`, "
              "Lightning's its tests/ requirements)", file=sys.stderr)  # fmt: skip
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
