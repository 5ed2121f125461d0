#!/usr/bin/env bash
# The test command (README, .ci/run). With no arguments, CI's whole run, in passes:
#   install         .venv if needed (scripts/bootstrap.sh)
#   main            the whole suite, on $LAZYCKPT_WORKERS pytest-xdist workers (default 2, one per core)
#   one-thread      the core and levels tests again with OMP_NUM_THREADS=1: torch on one thread is the
#                   spare-core regime (copies run beside training), where tests that wait for a copy whose
#                   source save nobody confirmed once waited 60 s
#   docs            the documentation site built with warnings as errors (mkdocs --strict), and the benchmark
#                   tables checked against benchmarks/results/ (python -m benchmarks.report --check)
#   package         python -m build (wheel and sdist) and twine check
#   install-oldest  .venv-oldest: the oldest supported Lightning and Accelerate, without transformers
#   oldest          the framework-internals tests on those versions (OLDEST_TESTS: the rule is below)
# With arguments, only the main pass, with the arguments given to pytest (-n 0 runs it without workers).
# At the end it prints each pass's wall time and the 15 slowest tests (scripts/test_report.py summary);
# .test-results/ keeps each pass's JUnit XML and wall time. LAZYCKPT_SKIP_OLDEST=1 skips the oldest pass.
set -uo pipefail
cd "$(dirname "$0")/.."
# Compiled modules are cached (__pycache__, git-ignored) even where the environment says not to: each test
# process imports lazyckpt and its tests' helpers, and compiling them from source in each costs CPU the
# tests share (2 cores).
unset PYTHONDONTWRITEBYTECODE
OLDEST_PINS="lightning==2.5.6 accelerate==1.13.0"
ONE_THREAD_TESTS=(
  tests/test_job_state.py tests/test_lifecycle.py tests/test_pool.py tests/test_promise.py tests/test_remove.py
  tests/test_inplace_mutators.py tests/test_zero_copy.py tests/test_reuse_pages.py
  tests/test_levels.py tests/test_levels_pins.py tests/test_levels_retention.py tests/test_levels_folders.py
)
# The oldest pass's selection rule: the integration tests (-m integration) of the files that reach a
# framework's internals with the framework in the test's own process (the plugin's hooks into the
# Trainer and Fabric, the Accelerator's save_state/load_state patches, the FSDP save patch, the version
# checks: everything lightning/_compat.py and accelerate/_compat.py touch), plus each integration's
# save/resume round trip across processes (Lightning DDP fit and resume, two-process save_state and
# stock load_state). What the oldest versions cannot change (the engine, the levels, replication, the
# files) is not run again there. A new test of a framework's internals goes into one of these files.
OLDEST_TESTS=(
  tests/test_lightning.py tests/test_lightning_failed_fit.py tests/test_pytorch_lightning_only.py
  tests/test_lightning_ddp.py tests/test_versions.py
  tests/test_accelerate.py tests/test_accelerate_fsdp.py tests/test_accelerate_multiproc.py
  tests/test_accelerate_remote.py
)
RESULTS=.test-results
WORKERS=${LAZYCKPT_WORKERS:-2}
PY=$(command -v python3 || command -v python)

rm -rf "$RESULTS"
mkdir -p "$RESULTS"

timed() {  # pass name, command...: runs it, writes $RESULTS/<name>.wall, returns its status
  local name=$1 start rc
  shift
  start=$(date +%s.%N)
  "$@"
  rc=$?
  "$PY" -c "import sys,time; print(f'{time.time() - float(sys.argv[1]):.1f} rc={sys.argv[2]}')" "$start" "$rc" \
    >"$RESULTS/$name.wall"
  return "$rc"
}

run_pytest() {  # pass name, venv, pytest args...: pytest's status, with "no tests collected" as a failure
  local name=$1 venv=$2
  shift 2
  timed "$name" "$venv/bin/python" -m pytest --junitxml="$RESULTS/$name.xml" --durations=15 "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: treating as a failure (the suite must never be empty)" >&2
    return 1
  fi
  return "$rc"
}

finish() {
  "$PY" scripts/test_report.py summary "$RESULTS" || true
  exit "$1"
}

timed install bash scripts/bootstrap.sh || finish 1
workers=(-n "$WORKERS" --dist loadfile)
for arg in "$@"; do  # the caller's own -n / --numprocesses / -p no:xdist wins
  case $arg in -n | -n* | --numprocesses* | xdist | no:xdist) workers=() ;; esac
done
run_pytest main .venv "${workers[@]}" "$@"
rc=$?
if [ "$#" -eq 0 ]; then
  echo "== core and levels tests with OMP_NUM_THREADS=1 (the spare-core regime)"
  OMP_NUM_THREADS=1 run_pytest one-thread .venv -q "${workers[@]}" "${ONE_THREAD_TESTS[@]}"
  one=$?
  [ "$rc" -eq 0 ] && rc=$one
fi
if [ "$#" -eq 0 ]; then
  echo "== docs: the site builds with warnings as errors; the benchmark tables match the committed results"
  timed docs bash -c '.venv/bin/python -m benchmarks.report --check &&
    .venv/bin/python -m mkdocs build --strict --quiet --site-dir "$0/site"' "$RESULTS"
  d=$?
  echo "== package: a wheel and an sdist build, and twine check passes"
  timed package bash -c 'rm -rf "$0/dist" && .venv/bin/python -m build --outdir "$0/dist" . >"$0/build.log" 2>&1 &&
    .venv/bin/python -m twine check --strict "$0"/dist/*' "$RESULTS"
  p=$?
  [ "$rc" -eq 0 ] && rc=$d
  [ "$rc" -eq 0 ] && rc=$p
fi
if [ "$#" -eq 0 ] && [ -z "${LAZYCKPT_SKIP_OLDEST:-}" ]; then
  echo "== framework-internals tests on the oldest supported frameworks ($OLDEST_PINS)"
  # without transformers: tests/test_transformers.py must skip cleanly where it is not installed
  LAZYCKPT_VENV=.venv-oldest LAZYCKPT_PINS="$OLDEST_PINS" LAZYCKPT_EXTRAS="test,lightning,accelerate,s3" \
    timed install-oldest bash scripts/bootstrap.sh || finish 1
  run_pytest oldest .venv-oldest -m integration -q "${workers[@]}" "${OLDEST_TESTS[@]}"
  old=$?
  [ "$rc" -eq 0 ] && rc=$old
fi
finish "$rc"
