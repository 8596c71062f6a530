#!/usr/bin/env bash
# The loop's speed, side by side with a previous commit: medians of N wall-clock runs of
#   A. the default `pytest --kvconform` from an empty folder (README command 1's run), and
#   B. (with --tests) README command 2, `pytest tests -n auto`,
# for the working tree and for BASE (default: HEAD~1), on this machine, one after the other (never in parallel).
#
#   ci/bench_loop.sh [--runs N] [--base REV] [--tests] [--python PATH]
#
# BASE is checked out with `git worktree add` under a temp folder (removed at the end). Both use the same Python
# environment (--python, default .venv/bin/python). Prints each run's wall time, then "median A/B: base → now".
# Timings are of this machine under its current load: compare the two columns, not the numbers across machines.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3 base=HEAD~1 tests=0 py=.venv/bin/python
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2;; --base) base=$2; shift 2;; --tests) tests=1; shift;; --python) py=$2; shift 2;;
    *) echo "unknown argument $1" >&2; exit 4;;
  esac
done
py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")
now=$PWD
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/base" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add --detach "$tmp/base" "$base" >/dev/null 2>&1

wall() {  # wall seconds of "$@" (run in the current folder), its output to a log
  local start end
  start=$(date +%s.%N)
  "$@" > "$tmp/last.log" 2>&1 || true
  end=$(date +%s.%N)
  python3 -c "print(f'{$end - $start:.1f}')"
}

median() { python3 -c "import statistics,sys; print(f'{statistics.median(map(float, sys.argv[1:])):.1f}')" "$@"; }

declare -A times
for tree in base now; do
  root=$now; [ "$tree" = base ] && root=$tmp/base
  for i in $(seq "$runs"); do
    empty=$(mktemp -d)
    t=$(cd "$empty" && PYTHONPATH="$root" wall "$py" -m pytest --kvconform -p no:cacheprovider -q)
    rm -rf "$empty"
    echo "$tree default run $i: $t s"
    times[$tree-A]="${times[$tree-A]:-} $t"
    if [ "$tests" = 1 ]; then
      t=$(cd "$root" && PYTHONPATH="$root" wall "$py" -m pytest tests -n auto -p no:cacheprovider -q)
      echo "$tree tests run $i: $t s"
      times[$tree-B]="${times[$tree-B]:-} $t"
    fi
  done
done
echo "median A (pytest --kvconform, empty folder): $(median ${times[base-A]}) s ($base) → $(median ${times[now-A]}) s (now)"
if [ "$tests" = 1 ]; then
  echo "median B (pytest tests -n auto): $(median ${times[base-B]}) s ($base) → $(median ${times[now-B]}) s (now)"
fi
