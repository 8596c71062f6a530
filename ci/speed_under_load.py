#!/usr/bin/env python3
"""The speed family under load: run it N times while CPU-bound processes compete for the cores, and count flips.

    python ci/speed_under_load.py [--runs 5] [--burners 2] [--burn-seconds 120] [--out DIR] [-- extra pytest args]

Each run starts ``--burners`` processes spinning ``while True: pass`` (each bounded by ``timeout --burn-seconds``),
then ``pytest --kvconform -m kvconform_speed --kvconform-model llama --kvconform-model gpt2 --kvconform-json`` in an
empty folder, then stops the burners. A *flip* is an item whose outcome is not the same in every run; a built-in
subject must have none and never fail. With ``--faulty`` the slow faulty caches (``SLOW_FAULTY``: faulty_perf,
faulty_prefill; and any ``--kvconform-cache`` given after ``--``) run too; they must fail in every run. Prints one
line per run and a summary; exit 1 on a flip or on a faulty cache that passed. Uses the interpreter it is run with.
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

SLOW_FAULTY = ("kvconform.testing.faulty_perf:DefragmentEveryStepCache",
               "kvconform.testing.faulty_prefill:TokenLoopPrefillCache")


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
    faulty_names = set()
    if args.faulty:
        for spec in SLOW_FAULTY:
            extra += ["--kvconform-cache", spec]
    faulty_names |= {a.rpartition(":")[2] for a in extra if ":" in a}
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
                      f"{m.get('growth', m.get('speedup'))}, confirmation {m['confirmation']}")
        faulty = key[0] in faulty_names
        if len(kinds) > 1:
            flips.append((key, [o for o, _ in seen]))
        if faulty and kinds != {"failed"} and kinds != {"skipped"}:  # skipped everywhere: not measurable here
            bad.append((key, "faulty cache not caught in every run", [o for o, _ in seen]))
        if not faulty and "failed" in kinds:
            bad.append((key, "built-in subject failed", [o for o, _ in seen]))
    ran = [k for k, seen in outcomes.items() if any(o in ("passed", "failed") for o, _ in seen)]
    print(f"items measured: {len(ran)} (of {len(outcomes)}); flips: {len(flips)}; "
          f"first measurements over budget that the confirmation overruled or confirmed: {confirmations}")
    for key, seen in flips:
        print("FLIP", " · ".join(key), seen)
    for key, why, seen in bad:
        print("BAD", " · ".join(key), why, seen)
    for name in sorted(faulty_names):
        got = [o for (s, _, _), seen in outcomes.items() if s == name for o, _ in seen]
        print(f"faulty {name}: {collections.Counter(got)}")
    print(f"reports and logs: {out}")
    return 1 if flips or bad else 0


if __name__ == "__main__":
    sys.exit(main())
