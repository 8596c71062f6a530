#!/usr/bin/env python3
"""The speed family under load: run it N times while CPU-bound processes compete for the cores, and count flips.

    python ci/speed_under_load.py [--runs 5] [--burners 2] [--burn-seconds 120] [--out DIR] [-- extra pytest args]

Each run starts ``--burners`` processes spinning ``while True: pass`` (each bounded by ``timeout --burn-seconds``),
then ``pytest --kvconform -m kvconform_speed --kvconform-model llama --kvconform-model gpt2 --kvconform-json`` in an
empty folder, then stops the burners. A *flip* is an item whose outcome is not the same in every run; a built-in
subject must have none and never fail. With ``--faulty`` the slow faulty caches of ``kvconform/testing`` (every
bundled faulty cache of the speed family: ``faulty_perf``, ``faulty_prefill``, ``lossy.Int8DequantPerToken``) run
too, each of which must fail its target case (``FaultyCache.case``) in every run; a cache given with
``--kvconform-cache`` after ``--`` must fail some item in every run. Prints one line per run and a summary; exit 1 on
a flip of a built-in subject, a built-in failure, or a faulty cache not caught in every run. Uses the interpreter it
is run with.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path



def slow_faulty() -> dict[str, str]:
    """``{cache spec: target case}`` of the bundled faulty caches of the speed family."""
    from kvconform.testing import faulty_caches

    return {f.spec: f.case for f in faulty_caches() if f.family == "speed"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--burn-seconds", type=int, default=120)
    parser.add_argument("--out", default=None, help="folder for the JSON reports (default: a temp folder)")
    parser.add_argument("--faulty", action="store_true", help="also run the slow faulty caches (must fail)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="kvconform-load-"))
    out.mkdir(parents=True, exist_ok=True)
    extra = list(args.pytest_args)
    targets: dict[str, str | None] = {a.rpartition(":")[2]: None for a in extra if ":" in a}  # subject → case
    if args.faulty:
        for spec, case in slow_faulty().items():
            extra += ["--kvconform-cache", spec]
            targets[spec.rpartition(":")[2]] = case
    faulty_names = set(targets)
    outcomes = collections.defaultdict(list)
    for run in range(args.runs):
        burners = [subprocess.Popen(["timeout", str(args.burn_seconds), sys.executable, "-c", "while True: pass"])
                   for _ in range(args.burners)]
        report = out / f"run{run}.json"
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as empty:
            proc = subprocess.run([sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider", "-q",
                                   "-m", "kvconform_speed", "--kvconform-model", "llama", "--kvconform-model", "gpt2",
                                   "--kvconform-json", str(report), *extra], cwd=empty, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                      [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])})
        wall = time.perf_counter() - start
        for b in burners:
            b.terminate()
            b.wait()
        (out / f"run{run}.log").write_text(proc.stdout + proc.stderr)
        results = json.loads(report.read_text())["results"]
        counts = collections.Counter(r["outcome"] for r in results)
        for r in results:
            outcomes[(r["subject"], r["model"], r["case"])].append((r["outcome"], r["metrics"]))
        print(f"run {run + 1}/{args.runs}: exit {proc.returncode}, {wall:.0f} s, {dict(counts)}", flush=True)
    flips, bad = [], []
    confirmations = 0
    for key, seen in sorted(outcomes.items()):
        kinds = {o for o, _ in seen}
        confirmations += sum("confirmation" in m for _, m in seen)
        for outcome, m in seen:
            if "confirmation" in m and key[0] not in faulty_names:
                print(f"confirmation overruled a first measurement: {' · '.join(key)}: {outcome}, first "
                      f"{m.get('growth', m.get('speedup', m.get('prefill_ratio')))}, confirmation {m['confirmation']}")
        if key[0] in faulty_names:
            if len(kinds) > 1:  # reported, not judged: a faulty cache is judged by its target case below
                print("faulty cache, outcome not the same in every run:", " · ".join(key), [o for o, _ in seen])
            continue
        if len(kinds) > 1:
            flips.append((key, [o for o, _ in seen]))
        if "failed" in kinds:
            bad.append((key, "built-in subject failed", [o for o, _ in seen]))
    for name, case in sorted(targets.items(), key=lambda kv: kv[0]):
        runs = [[] for _ in range(args.runs)]  # per run: the outcomes of the items that catch it
        for (subject, _, item_case), seen in outcomes.items():
            if subject == name and (case is None or item_case == case):
                for i, (o, _) in enumerate(seen):
                    runs[i].append(o)
        caught = ["failed" in run for run in runs]
        what = f"its target case {case}" if case else "any item"
        print(f"faulty {name}: caught by {what} in {sum(caught)} of {args.runs} runs")
        if not all(caught) and any(runs):
            bad.append(((name, "-", case or "*"), f"faulty cache not caught by {what} in every run", caught))
    ran = [k for k, seen in outcomes.items() if any(o in ("passed", "failed") for o, _ in seen)]
    print(f"items measured: {len(ran)} (of {len(outcomes)}); flips: {len(flips)}; "
          f"first measurements over budget that the confirmation overruled or confirmed: {confirmations}")
    for key, seen in flips:
        print("FLIP", " · ".join(key), seen)
    for key, why, seen in bad:
        print("BAD", " · ".join(key), why, seen)
    print(f"reports and logs: {out}")
    return 1 if flips or bad else 0


if __name__ == "__main__":
    sys.exit(main())
