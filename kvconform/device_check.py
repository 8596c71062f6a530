"""The prepared GPU check: one command a person (or a CI job with a GPU) runs on a CUDA machine, writing one JSON
report of everything kvconform can only measure there, within one 10-minute call.

    PYTHONPATH=/path/to/kvconform python -m kvconform.device_check --out device_check.json   # a clone, no install
    kvconform-device-check --out device_check.json      # the same where kvconform is installed
    kvconform-device-check --smoke --out smoke.json     # CPU: every step's code path at tiny size, `cuda` planned

No build step and no registry: a clone on ``PYTHONPATH`` over an environment with torch (CUDA), transformers ≥ 5.5,
pytest and pytest-xdist is enough. Each step runs in a temporary folder with ``PYTHONPATH`` set to the folder this
``kvconform`` was imported from (absolute), and with ``-p kvconform.plugin`` where the pytest11 entry point is not
installed, so a relative ``PYTHONPATH`` or a run from another folder works too.

Steps (``STEPS``), each a subprocess (its own process group, ended with SIGTERM then SIGKILL at its limit) with its
own time limit, all within ``--budget`` seconds (default ``BUDGET_S`` = 540, one 10-minute call with a minute to
spare); a step that fails or times out is recorded and the next one still runs; the report is written after every
step (``complete`` false until the last), so a call that ends early still leaves every finished step's part:

1. ``preflight`` (30 s): in the steps' folder and environment, kvconform and its plugin import from this clone;
   the versions of torch, CUDA, transformers, mamba-ssm, causal-conv1d, flash-attn, optimum-quanto, hqq, kernels;
   the device name and ``nvcc``.
2. ``plan`` (60 s): the default tier's plan for ``--kvconform-device cuda`` (``plan_summary``): how many items a
   GPU run plans, runs, skips (by reason) and judges, with each judged speed / memory / compile budget. On CPU
   (``--smoke``) the plan is made as if CUDA were present (``compat.planned_as_cuda``): the device-generic code
   with ``cuda`` in the plan, as far as a CPU can.
3. ``conformance`` (270 s; smoke 300): ``pytest --kvconform --kvconform-device cuda --kvconform-timeout 90``: the
   bf16 / fp16 cases through CUDA's SDPA kernels, mamba / mamba2 through mamba-ssm's kernels where they import,
   the offloaded caches, CUDA-graph compile, ``torch.cuda.memory_allocated``; the quanto subjects are left out
   (``-k "not quanto"``) unless ``--with-quanto``: optimum-quanto builds its CUDA extension with nvcc on first use,
   minutes of the call. The JSON report is written as items finish, so a timeout keeps what finished. Smoke:
   llama only, the float32 decode and the bf16 / fp16 cases, on CPU.
4. ``gpu_bench`` (170 s): ``kvconform-gpu-bench`` (allocator memory, eager decode speed, then the compiled static
   cache, on a 1.1B-parameter model in bf16, each speed as measured / bandwidth floor), writing its JSON after each
   section. Smoke: ``--smoke``.

The report (``--out``, schema 2): ``mode`` (``cuda`` / ``smoke``), ``complete``, ``budget_s``, ``environment``,
``steps`` (name, command, exit code, wall seconds, limit, timed out), ``preflight``, ``plan``, ``conformance``
(outcome counts, items per dtype, failures' ids and first lines, the skip reasons of GPU-bound items that still
skipped) and ``gpu_bench`` (that script's report, partial if it was cut). Exit code 0 when every step exits 0; 1
otherwise; 4 for a usage mistake (no CUDA without ``--smoke``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# the GPU-bound families and subjects: their skips in a CUDA run are the lane that did not run
GPU_BOUND = ("mamba", "offloaded", "cuda", "CUDA", "nvcc")

BUDGET_S = 540
"""Seconds the whole check may take by default: one 10-minute call, less a minute for the interpreter's start and
the transfers."""

PACKAGES = ("transformers", "mamba-ssm", "causal-conv1d", "flash-attn", "optimum-quanto", "hqq", "kernels",
            "pytest", "pytest-xdist")


@dataclass(frozen=True)
class Step:
    """One step of the check: ``name``, its time limit ``timeout_s`` (seconds) on CUDA and in smoke mode."""

    name: str
    timeout_s: int
    smoke_timeout_s: int


# within BUDGET_S on one GPU: the default tier is ~1 min of CPU work on 2 cores; on a GPU its tiny models are
# launch-bound, a cold CUDA-graph compile takes tens of seconds per model (per-item limit 90 s), and the benchmark's
# 1.1B model needs its build, warm-up and one compile
STEPS = (Step("preflight", 30, 60), Step("plan", 60, 120), Step("conformance", 270, 300), Step("gpu_bench", 170, 240))

ITEM_TIMEOUT_S = 90
"""``--kvconform-timeout`` of the conformance step on CUDA: a cold compile may take a minute, never the step."""

PREFLIGHT = """
import json, shutil, sys
out = {"executable": sys.executable}
import kvconform, kvconform.plugin
out["kvconform"] = kvconform.__file__
import torch
out["torch"] = torch.__version__
out["cuda"] = torch.version.cuda
out["cuda_available"] = torch.cuda.is_available()
out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
from kvconform import compat
out["nvcc"] = not compat.missing_tool("nvcc")
import transformers
out["transformers"] = transformers.__version__
print(json.dumps(out))
"""


def package_root() -> str:
    """The absolute folder this ``kvconform`` package was imported from (what ``PYTHONPATH`` must hold)."""
    return str(Path(__file__).resolve().parent.parent)


def step_env(smoke: bool) -> dict:
    """The environment of every step: this process's, with ``package_root()`` first on ``PYTHONPATH`` (absolute, so
    a step in another folder imports the same kvconform), unbuffered output, and in smoke mode no workers."""
    paths = [package_root(), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))
    if smoke:  # six items: worker processes would cost more start-up than they save
        env.setdefault("KVCONFORM_WORKERS", "0")
    return env


def _plugin_args() -> list[str]:
    """``-p kvconform.plugin`` where the pytest11 entry point is not installed (kvconform on ``PYTHONPATH`` only)."""
    names = {ep.name for ep in metadata.entry_points(group="pytest11")}
    return [] if "kvconform" in names else ["-p", "kvconform.plugin"]


def preflight_command(report: Path) -> list[str]:
    """Step 1: import kvconform (and its plugin) where the steps run and write what it found to ``report``."""
    code = PREFLIGHT + f"open({str(report)!r}, 'w').write(json.dumps(out))\n"
    return [sys.executable, "-c", code]


def plan_command(smoke: bool, report: Path) -> list[str]:
    """Step 2: ``python -m kvconform.device_check --plan-only REPORT`` (``plan_summary``)."""
    return [sys.executable, "-m", "kvconform.device_check", "--plan-only", str(report)] + (["--smoke"] if smoke
                                                                                             else [])


def conformance_command(smoke: bool, report: Path, with_quanto: bool = False) -> list[str]:
    """The pytest command of step 3, writing its JSON report to ``report``."""
    cmd = [sys.executable, "-m", "pytest", *_plugin_args(), "--kvconform", "-p", "no:cacheprovider", "-q",
           "--kvconform-json", str(report)]
    if smoke:
        return cmd + ["--kvconform-model", "llama", "--kvconform-subject", "DynamicCache",
                      "--kvconform-subject", "ReferenceCache", "-k",
                      "prefill_then_decode and (decode_explicit_positions or bf16_decode_padded or fp16_decode_padded)"]
    cmd += ["--kvconform-device", "cuda", "--kvconform-timeout", str(ITEM_TIMEOUT_S)]
    return cmd if with_quanto else cmd + ["-k", "not quanto"]


def bench_command(smoke: bool, report: Path) -> list[str]:
    """The command of step 4 (``kvconform.gpu_bench``), writing its JSON report to ``report``."""
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
        "device": torch.cuda.get_device_name(0) if cuda else None, "kvconform": package_root(),
        **{name: version(name) for name in PACKAGES},
    }


BUDGET_WORDS = ("min_", "max_", "slack", "tolerance", "abs_min")


def _budget_params(case) -> dict:
    """The params of ``case`` that are budgets (``min_*``, ``max_*``, slacks, tolerances) and its CUDA mode."""
    return {k: v for k, v in sorted(case.params.items())
            if any(k.startswith(w) or w in k for w in BUDGET_WORDS) or k in ("mode", "device")}


def plan_summary(items) -> dict:
    """What a run of ``items`` (``session.items()``) plans, skips and judges: counts of items that run, are skipped
    (by reason, the 40 most frequent) or expected to fail; per family the checks that run; and for the speed,
    memory and compile families each judged (check, case) with its budget params (``_budget_params``) and the
    subjects × models it judges."""
    runs = [i for i in items if not i.skip]
    skipped: dict[str, int] = {}
    for item in items:
        if item.skip:
            skipped[item.skip] = skipped.get(item.skip, 0) + 1
    families: dict[str, dict[str, int]] = {}
    budgets: dict[str, dict] = {}
    for item in runs:
        family = families.setdefault(item.check.family, {})
        family[item.check.name] = family.get(item.check.name, 0) + 1
        if item.check.family in ("speed", "memory", "compile"):
            entry = budgets.setdefault(f"{item.check.name}:{item.case.id}",
                                       {"budget": _budget_params(item.case), "items": []})
            entry["items"].append(f"{item.subject.name}-{item.model.name}")
    gpu = {reason: n for reason, n in skipped.items() if any(word in reason for word in GPU_BOUND)}
    return {"items": len(items), "run": len(runs), "skipped": len(items) - len(runs),
            "expected_to_fail": sum(1 for i in runs if i.xfail),
            "skip_reasons": dict(sorted(skipped.items(), key=lambda kv: -kv[1])[:40]), "gpu_bound_skips": gpu,
            "run_by_family": families, "judged_budgets": budgets}


def make_plan(smoke: bool) -> dict:
    """The default tier's plan for ``--kvconform-device cuda`` (``plan_summary``), with ``planned_as_cuda`` where
    CUDA is absent (``smoke``); ``device_name`` is the GPU's, or None."""
    import torch

    from kvconform import compat
    from kvconform.session import build_session

    cuda = torch.cuda.is_available()
    if not cuda and not smoke:
        raise RuntimeError("no CUDA: plan with --smoke")
    started = time.perf_counter()
    with compat.planned_as_cuda() if not cuda else contextlib.nullcontext():
        items = build_session(device="cuda", runs_items=False).items()
        summary = plan_summary(items)
    return {"device": "cuda", "planned_as_cuda": not cuda, "device_name": torch.cuda.get_device_name(0) if cuda
            else None, "seconds": round(time.perf_counter() - started, 1), **summary}


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
            "gpu_bound_skips": gpu_skips, "complete": data.get("complete"), "planned": data.get("planned")}


def run_step(step: Step, command: list[str], smoke: bool, cwd: str, limit: float) -> dict:
    """Run one step's ``command`` in ``cwd`` (environment ``step_env``) within ``limit`` seconds, in its own
    process group: at the limit the group gets SIGTERM (pytest writes its report on it), then SIGKILL after 15 s.
    Its output goes to this process's stdout."""
    print(f"=== {step.name}: {' '.join(command)[:400]} (limit {limit:.0f} s)", flush=True)
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env=step_env(smoke), start_new_session=True)
    timed_out = False
    try:
        rc = proc.wait(timeout=max(limit, 1))
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        rc = 124
    wall = time.perf_counter() - started
    print(f"=== {step.name}: exit {rc} after {wall:.1f} s{' (timed out)' if timed_out else ''}", flush=True)
    return {"name": step.name, "command": command, "exit_code": rc, "wall_s": round(wall, 1),
            "limit_s": round(limit), "timed_out": timed_out}


def _read(path: Path):
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):  # a report cut while it was written
        return None


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``kvconform-device-check``); returns the exit code."""
    parser = argparse.ArgumentParser(prog="kvconform-device-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="device_check.json", help="the JSON report (default: device_check.json)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny: every step's code path, the plan made with cuda, no GPU verdicts")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for the whole check (default {BUDGET_S}: one 10-minute call)")
    parser.add_argument("--steps", default=",".join(s.name for s in STEPS),
                        help="comma-separated steps to run (default: all, in order)")
    parser.add_argument("--with-quanto", action="store_true",
                        help="keep the quanto subjects in the conformance step (optimum-quanto builds its CUDA "
                             "extension with nvcc on first use: minutes)")
    parser.add_argument("--plan-only", metavar="PATH", help=argparse.SUPPRESS)  # step 2, in its own process
    args = parser.parse_args(argv)
    names = [n for n in args.steps.split(",") if n]
    unknown = sorted(set(names) - {s.name for s in STEPS})
    if unknown:
        print(f"kvconform-device-check: --steps {args.steps!r}: unknown step(s) {unknown}; steps: "
              f"{', '.join(s.name for s in STEPS)}", file=sys.stderr)
        return 4

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("kvconform-device-check: CUDA is not available in this torch build/machine; run it on a GPU machine, "
              "or pass --smoke for the CPU smoke run", file=sys.stderr)
        return 4
    if args.plan_only:
        Path(args.plan_only).write_text(json.dumps(make_plan(args.smoke), indent=2))
        return 0
    started = time.perf_counter()
    out = Path(args.out).resolve()
    report: dict = {"schema": 2, "mode": "smoke" if args.smoke else "cuda", "complete": False,
                    "budget_s": args.budget, "environment": environment(), "steps": []}
    out.write_text(json.dumps(report, indent=2))
    with tempfile.TemporaryDirectory(prefix="kvconform-device-") as work:
        files = {name: Path(work, f"{name}.json") for name in ("preflight", "plan", "conformance", "gpu_bench")}
        commands = {"preflight": preflight_command(files["preflight"]),
                    "plan": plan_command(args.smoke, files["plan"]),
                    "conformance": conformance_command(args.smoke, files["conformance"], args.with_quanto),
                    "gpu_bench": bench_command(args.smoke, files["gpu_bench"])}
        for step in STEPS:
            if step.name not in names:
                continue
            left = args.budget - (time.perf_counter() - started)
            limit = min(step.smoke_timeout_s if args.smoke else step.timeout_s, left)
            if limit < 5:
                report["steps"].append({"name": step.name, "exit_code": None, "skipped": "no time left in --budget"})
                continue
            report["steps"].append(run_step(step, commands[step.name], args.smoke, work, limit))
            for name in ("preflight", "plan", "gpu_bench"):
                report[name] = _read(files[name])
            data = _read(files["conformance"])
            report["conformance"] = summarize_conformance(data) if data is not None else None
            out.write_text(json.dumps(report, indent=2))  # after every step: a call cut short keeps its part
    report["complete"] = True
    report["wall_s"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(report, indent=2))
    ok = all(s["exit_code"] == 0 for s in report["steps"])
    summary = report.get("conformance") or {}
    print(f"kvconform-device-check ({report['mode']}): {'ok' if ok else 'FAILED'}; conformance "
          f"{summary.get('outcomes')}; steps " + ", ".join(f"{s['name']} {s['exit_code']} ({s.get('wall_s')} s)"
                                                          for s in report["steps"]) + f"; report: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
