"""The prepared GPU check: one command a person (or a CI job with a GPU) runs on a CUDA machine, writing one JSON
report of everything kvconform can only measure there.

    kvconform-device-check --out device_check.json     # CUDA: ≤ 8 minutes on one GPU (python -m kvconform.device_check)
    kvconform-device-check --smoke --out smoke.json    # CPU, ~1 min: the same steps at tiny size, no GPU verdicts

Steps, each a subprocess with its own time limit (``STEPS``), run in order; a step that fails or times out is
recorded and the next one still runs:

1. ``conformance``: the default tier, ``pytest --kvconform --kvconform-device cuda``: every zoo model, the bf16 /
   fp16 cases through CUDA's SDPA kernels, mamba / mamba2 through mamba-ssm's kernels where ``mamba-ssm`` and
   ``causal-conv1d`` import (``check_mamba_kernels``), the offloaded caches (``DynamicCache_offloaded``,
   ``StaticCache_offloaded``), CUDA-graph compile and ``torch.cuda.memory_allocated``. Smoke: llama only, the
   float32 decode and the bf16 / fp16 cases, on CPU.
2. ``gpu_bench``: ``kvconform-gpu-bench`` (per-token decode speed, the compiled static cache, allocator memory on a
   1.1B-parameter model in bf16). Smoke: ``--smoke``.

The report (``--out``, schema 1): ``mode`` (``cuda`` / ``smoke``), ``environment`` (torch, CUDA device, transformers,
mamba-ssm, causal-conv1d, flash-attn versions or None), ``steps`` (name, command, exit code, wall seconds, timed out),
``conformance`` (outcome counts, items per dtype, the ids and first lines of failures, and the skip reasons of the
GPU-bound items that still skipped: the part of the GPU lane that did not run, e.g. mamba-ssm not installed) and
``gpu_bench`` (that script's own JSON report). Exit code 0 when every step exits 0; 1 otherwise; 4 for a usage
mistake (no CUDA without ``--smoke``).

On a machine with no package registry (a lent GPU box), install kvconform with ``pip install --no-deps -e .`` over an
environment that has torch (CUDA), transformers ≥ 5.5, pytest and pytest-xdist; where the entry point is not
installed, the step runs ``pytest -p kvconform.plugin`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# the GPU-bound families and subjects: their skips in a CUDA run are the lane that did not run
GPU_BOUND = ("mamba", "offloaded", "cuda", "CUDA")


@dataclass(frozen=True)
class Step:
    """One step of the check: ``name``, its time limit ``timeout_s`` (seconds) on CUDA and in smoke mode."""

    name: str
    timeout_s: int
    smoke_timeout_s: int


# 8 minutes in all on one GPU: the default tier takes ~1 min of CPU work on 2 cores; on a GPU its tiny models are
# launch-bound, so most of the budget is the benchmark's 1.1B model (build, warm-up, compile)
STEPS = (Step("conformance", 270, 300), Step("gpu_bench", 210, 240))


def _plugin_args() -> list[str]:
    """``-p kvconform.plugin`` where the pytest11 entry point is not installed (kvconform on ``PYTHONPATH`` only)."""
    names = {ep.name for ep in metadata.entry_points(group="pytest11")}
    return [] if "kvconform" in names else ["-p", "kvconform.plugin"]


def conformance_command(smoke: bool, report: Path) -> list[str]:
    """The pytest command of step 1, writing its JSON report to ``report``."""
    cmd = [sys.executable, "-m", "pytest", *_plugin_args(), "--kvconform", "-p", "no:cacheprovider", "-q",
           "--kvconform-json", str(report)]
    if smoke:
        return cmd + ["--kvconform-model", "llama", "--kvconform-subject", "DynamicCache",
                      "--kvconform-subject", "ReferenceCache", "-k",
                      "prefill_then_decode and (decode_explicit_positions or bf16_decode_padded or fp16_decode_padded)"]
    return cmd + ["--kvconform-device", "cuda"]


def bench_command(smoke: bool, report: Path) -> list[str]:
    """The command of step 2 (``kvconform.gpu_bench``), writing its JSON report to ``report``."""
    return [sys.executable, "-m", "kvconform.gpu_bench", "--out", str(report)] + (["--smoke"] if smoke else [])


def environment() -> dict:
    """Versions of what the GPU lane depends on (None where not installed) and the CUDA device, if any."""
    import torch

    def version(dist: str):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else None,
        **{name: version(name) for name in ("transformers", "mamba-ssm", "causal-conv1d", "flash-attn",
                                             "optimum-quanto", "hqq")},
    }


def summarize_conformance(data: dict) -> dict:
    """Outcome counts, items per dtype, failures (id and first message line) and the GPU-bound skips of a
    ``--kvconform-json`` report ``data``."""
    outcomes: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    failures, gpu_skips = [], {}
    for r in data.get("results", []):
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
        dtypes[r.get("dtype", "?")] = dtypes.get(r.get("dtype", "?"), 0) + 1
        message = (r.get("message") or "").strip()
        if r["outcome"] in ("failed", "internal"):
            failures.append({"id": r.get("nodeid") or r.get("id"), "first_line": message.splitlines()[0]
                             if message else ""})
        elif r["outcome"] == "skipped" and any(word in message for word in GPU_BOUND):
            gpu_skips[message] = gpu_skips.get(message, 0) + 1
    return {"items": sum(outcomes.values()), "outcomes": outcomes, "dtypes": dtypes, "failures": failures,
            "gpu_bound_skips": gpu_skips, "complete": data.get("complete")}


def run_step(step: Step, command: list[str], smoke: bool, cwd: str) -> dict:
    """Run one step's ``command`` in ``cwd`` under its time limit; its output goes to this process's stdout."""
    limit = step.smoke_timeout_s if smoke else step.timeout_s
    print(f"=== {step.name}: {' '.join(command)} (limit {limit} s)", flush=True)
    started = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if smoke:  # six items: worker processes would cost more start-up than they save
        env.setdefault("KVCONFORM_WORKERS", "0")
    try:
        rc = subprocess.run(command, cwd=cwd, env=env, timeout=limit).returncode
        timed_out = False
    except subprocess.TimeoutExpired:
        rc, timed_out = 124, True
    wall = time.perf_counter() - started
    print(f"=== {step.name}: exit {rc} after {wall:.1f} s{' (timed out)' if timed_out else ''}", flush=True)
    return {"name": step.name, "command": command, "exit_code": rc, "wall_s": round(wall, 1), "timed_out": timed_out}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``kvconform-device-check``); returns the exit code."""
    parser = argparse.ArgumentParser(prog="kvconform-device-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="device_check.json", help="the JSON report (default: device_check.json)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny: every step's code path, no GPU verdicts")
    args = parser.parse_args(argv)

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("kvconform-device-check: CUDA is not available in this torch build/machine; run it on a GPU machine, "
              "or pass --smoke for the CPU smoke run", file=sys.stderr)
        return 4
    out = Path(args.out).resolve()
    report: dict = {"schema": 1, "mode": "smoke" if args.smoke else "cuda", "environment": environment(),
                    "steps": []}
    with tempfile.TemporaryDirectory(prefix="kvconform-device-") as work:
        conformance_json, bench_json = Path(work, "conformance.json"), Path(work, "gpu_bench.json")
        commands = {"conformance": conformance_command(args.smoke, conformance_json),
                    "gpu_bench": bench_command(args.smoke, bench_json)}
        for step in STEPS:
            report["steps"].append(run_step(step, commands[step.name], args.smoke, work))
        report["conformance"] = (summarize_conformance(json.loads(conformance_json.read_text()))
                                 if conformance_json.exists() else None)
        report["gpu_bench"] = json.loads(bench_json.read_text()) if bench_json.exists() else None
    out.write_text(json.dumps(report, indent=2))
    ok = all(s["exit_code"] == 0 for s in report["steps"])
    summary = report["conformance"] or {}
    print(f"kvconform-device-check ({report['mode']}): {'ok' if ok else 'FAILED'}; conformance "
          f"{summary.get('outcomes')}; steps " + ", ".join(f"{s['name']} {s['exit_code']} ({s['wall_s']} s)"
                                                          for s in report["steps"]) + f"; report: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
