"""Measured shard timings of the every-architecture sweep: one run, then 2 shards, then 4, each shard run on its own
(serially, one after the other, as one CI machine per shard would run it), each set merged with ``kvconform-merge``
and compared item by item with the unsharded run.

    python ci/shard_timings.py --out /tmp/shards [--shards 1,2,4] [--models llama,gpt2,...] [-- extra pytest args]

Per shard it records the wall time of the run (``/usr/bin/time``; the CI wall time of that job), its collection
time alone (``--collect-only``: plugin start-up, the architecture survey read from its cache, planning and the
shard split — what every shard pays before its first item) and its item count. With N shards the CI wall time is
the slowest shard's. It exits 1 when a merged item → outcome map differs from the unsharded run's (an item that
passes or fails only in one of them) and prints which items.

The default sample (``SAMPLE``) is 12 architectures chosen to cover the kinds of model the sweep meets, in
proportion to their cost: dense attention with rotary (llama), learned absolute positions (gpt2), sliding + full
layers (gemma2), sliding everywhere (mistral), mixture of experts (mixtral), multi-head latent attention + MoE
(deepseek_v3), positions counted from padding_idx + 1 (roberta), an encoder-decoder's decoder registered as a causal
LM (bart), a pure SSM (mamba), an SSM / attention hybrid (jamba), hybrid layers holding both (falcon_h1) and a
linear-attention hybrid (qwen3_next). Run it on an otherwise idle machine: the times are wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SAMPLE = ("llama", "gpt2", "gemma2", "mistral", "mixtral", "deepseek_v3", "roberta", "bart", "mamba", "jamba",
          "falcon_h1", "qwen3_next")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _timed(cmd: list[str], cwd: str, log: str) -> tuple[float, int]:
    """Run ``cmd`` under ``/usr/bin/time``; return (wall seconds, exit status). Output goes to ``log``."""
    timing = log + ".time"
    with open(log, "w") as fh:
        rc = subprocess.call(["/usr/bin/time", "-f", "%e", "-o", timing, *cmd], cwd=cwd, stdout=fh,
                             stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": HERE})
    with open(timing) as fh:
        return float(fh.read().strip().splitlines()[-1]), rc


def _outcomes(path: str) -> dict:
    with open(path) as fh:
        return {r["nodeid"]: r["outcome"] for r in json.load(fh)["results"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the shards' JSON reports and logs")
    parser.add_argument("--shards", default="1,2,4", help="shard counts to run, comma-separated (1 = unsharded)")
    parser.add_argument("--models", default=",".join(SAMPLE), help="model types (transformers:<type> each)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    empty = tempfile.mkdtemp(prefix="kvconform-shards-")  # run from an empty folder: only the suite is collected
    base = [sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider", "-q", "-n", "0",
            *(f"--kvconform-model=transformers:{m}" for m in args.models.split(",")), *args.pytest_args]
    rows, reports, status = [], {}, 0
    for n in (int(s) for s in args.shards.split(",")):
        files = []
        for i in range(1, n + 1):
            shard = [f"--kvconform-shard={i}/{n}"] if n > 1 else []
            tag = f"{n}-{i}"
            collect, _ = _timed([*base, *shard, "--collect-only"], empty, os.path.join(args.out, f"collect-{tag}.log"))
            report = os.path.join(args.out, f"shard-{tag}.json")
            wall, rc = _timed([*base, *shard, f"--kvconform-json={report}"], empty,
                              os.path.join(args.out, f"run-{tag}.log"))
            items = len(_outcomes(report))
            rows.append((n, i, wall, collect, items, rc))
            print(f"{n} shard(s), shard {i}: {wall:.1f} s wall, collection {collect:.1f} s, {items} items, exit {rc}",
                  flush=True)
            files.append(report)
        merged = os.path.join(args.out, f"merged-{n}.json")
        subprocess.call([sys.executable, "-m", "kvconform.merge", "--json", merged, *files], cwd=empty,
                        stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": HERE,
                                                         "GITHUB_STEP_SUMMARY": os.devnull})
        reports[n] = _outcomes(merged)
    if 1 in reports:
        for n, got in reports.items():
            differ = sorted(k for k in set(got) | set(reports[1]) if got.get(k) != reports[1].get(k))
            print(f"{n} shard(s) merged: {len(got)} items, {len(differ)} differ from the unsharded run")
            for k in differ[:20]:
                print(f"  {k}: unsharded {reports[1].get(k)}, merged {got.get(k)}")
            status = status or bool(differ)
    print("\n| shards | shard | wall s | collection s | items |\n|---|---|---|---|---|")
    for n, i, wall, collect, items, _ in rows:
        print(f"| {n} | {i} | {wall:.1f} | {collect:.1f} | {items} |")
    for n in sorted({r[0] for r in rows}):
        walls = [r[2] for r in rows if r[0] == n]
        print(f"{n} shard(s): max {max(walls):.1f} s (CI wall time, one machine per shard), sum {sum(walls):.1f} s")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
