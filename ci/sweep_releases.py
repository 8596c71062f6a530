#!/usr/bin/env python
"""Run kvconform's default tier on several transformers releases and report, per known-faults entry, where it holds.

Each release is installed with ``pip install --no-deps --target <cache>/tf-<version> transformers==<version>`` (it
shares the running interpreter's torch, hqq, optimum-quanto: a quick install), plus — into the same folder — the
versions of ``huggingface-hub``, ``tokenizers`` and ``safetensors`` its metadata requires when the installed ones do
not satisfy it. The run itself is ``pytest --kvconform --kvconform-strict --kvconform-json ...`` in an empty folder
with ``PYTHONPATH=<target>:<this repository>``: strict, so every known fault fails and the report shows, per item,
whether it fails at all on that release. Each failed item is then matched against the known-faults entries with the
release's version:

* ``held``: an entry applying to the release matches the failed item (and its ``evidence``, if any): xfailed in a
  default run;
* ``XPASS``: an entry applying to the release matches an item that passed: the entry is too wide there;
* ``unlisted``: a failed item no applying entry matches: the default run fails there;
* ``also fails``: a failed item that an entry matches only by its fields, on a release outside its bounds: the bounds
  are too narrow.

A default (non-strict) run is green on a release exactly when it has no ``unlisted`` item and no ``XPASS``.

Usage (from the repository root; about 2-4 minutes per release on 2 idle cores, installs cached)::

    python ci/sweep_releases.py                         # the supported releases named in RELEASES
    python ci/sweep_releases.py --versions 5.16.1 5.24.0 --out /tmp/sweep --pytest-args "-n 2"
    python ci/sweep_releases.py --all                   # every release pip knows in the supported range

Exit status: 0 when every release is green, 1 when one is not, 4 on a usage or install problem.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RELEASES = ("5.5.4", "5.9.0", "5.13.1", "5.16.1", "5.20.2", "5.24.0", "5.25.0")
"""The supported releases CI sweeps: the oldest, the newest and one every few minor releases between."""
SUPPORTED = ">=5.5,<6"
PINNED_DEPS = ("huggingface-hub", "tokenizers", "safetensors")


def _requirements(dist_info: Path) -> list:
    from packaging.requirements import Requirement

    meta = (dist_info / "METADATA").read_text(encoding="utf-8")
    out = []
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None and req.name.lower() in PINNED_DEPS:
                out.append(req)
    return out


def install(version: str, cache: Path) -> Path | None:
    """Install transformers ``version`` into ``cache/tf-<version>`` (once) and return the folder; None when the
    running interpreter already has that version (no install needed). Raises ``RuntimeError`` naming the failed
    pip command."""
    if metadata.version("transformers") == version:
        return None
    target = cache / f"tf-{version}"
    stamp = target / ".kvconform-sweep-ok"
    if stamp.exists():
        return target
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(target)]
    _pip(pip + ["--no-deps", f"transformers=={version}"])
    dist = next(target.glob("transformers-*.dist-info"))
    for req in _requirements(dist):
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            # huggingface-hub brings its own small deps (httpx ...); tokenizers / safetensors are single wheels
            extra = [] if req.name.lower() == "huggingface-hub" else ["--no-deps"]
            _pip(pip + extra + ["--upgrade", str(req)])
    stamp.write_text("ok\n")
    return target


def _pip(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stderr[-2000:]}")


def all_releases() -> list:
    """Every transformers release pip's index lists in ``SUPPORTED`` (final releases only)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers"], capture_output=True,
                          text=True, check=True)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("Available versions:"))
    versions = [Version(v.strip()) for v in line.split(":", 1)[1].split(",")]
    spec = SpecifierSet(SUPPORTED)
    return [str(v) for v in sorted(versions) if v in spec and not v.is_prerelease]


def run_release(version: str, target: Path | None, out: Path, pytest_args: list) -> dict:
    """Run the strict default tier on one release; return the JSON report (and ``seconds``)."""
    report = out / f"kvconform-{version}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*( [str(target)] if target else []), str(REPO)])
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", "--kvconform", "--kvconform-strict", "--kvconform-json", str(report),
           "-q", "-p", "no:cacheprovider", *pytest_args]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvconform-sweep-") as empty:
        proc = subprocess.run(cmd, cwd=empty, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    (out / f"pytest-{version}.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if not report.exists():
        raise RuntimeError(f"release {version}: no report (exit {proc.returncode}); see {out}/pytest-{version}.log")
    data = json.loads(report.read_text(encoding="utf-8"))
    data["seconds"] = seconds
    return data


def classify(data: dict, faults: list) -> dict:
    """Per entry id: ``held`` / ``xpass`` / ``outside`` item counts; plus ``unlisted`` (failed items no applying
    entry matches) — for one release's strict report."""
    from packaging.version import Version

    version = Version(data["environment"]["transformers"])
    per_fault = {f.id: {"held": 0, "xpass": 0, "outside": 0} for f in faults}
    unlisted = []
    for r in data["results"]:
        if r["outcome"] in ("skipped",):
            continue
        fields = {k: r[k] for k in ("subject", "model", "check", "family", "case")}
        failed = r["outcome"] in ("failed", "error")
        applying = [f for f in faults if f.applies_to(version) and f.matches_fields(**fields)]
        if failed:
            shown = [f for f in applying if f.shown_by(r["message"]) and f.within(r.get("metrics") or {})]
            if shown:
                per_fault[shown[0].id]["held"] += 1
                continue
            unlisted.append(r)
            outside = [f for f in faults if not f.applies_to(version) and f.matches_fields(**fields)]
            for f in outside[:1]:
                per_fault[f.id]["outside"] += 1
        elif r["outcome"] in ("passed", "xpassed") and applying and not applying[0].judged_at_run_time:
            per_fault[applying[0].id]["xpass"] += 1  # marked xfail before the run: an XPASS in a default run
    return {"per_fault": per_fault, "unlisted": unlisted}


ENVELOPE_KEYS = ("missing", "broken", "is_croppable", "model_at_fault", "problems")
"""Metrics that describe a failure with neither a Δ nor an exception (a contract item's missing methods, a crop
that should have been refused, a fault the reference shares)."""


def measure_envelopes(reports: list, faults: list) -> dict:
    """Per entry id, what its failures measure over ``reports`` (strict JSON reports of several releases): an
    ``envelope`` table with a margin — ``max_abs`` (2x the largest Δ), ``bytes_ratio`` (1.5x), ``raised`` (the
    exception types seen) and, for failures with none of these, the ``ENVELOPE_KEYS`` values seen — or None for an
    entry some failure of which none of these describe; and per entry id the steps (``failed_at``) seen. Returns
    ``(envelopes, steps)``."""
    import math
    import re

    from kvconform.known_faults import metric

    from packaging.version import Version

    seen: dict = {}
    for data in reports:
        version = Version(data["environment"]["transformers"])
        for r in data["results"]:
            if r["outcome"] not in ("failed", "error"):
                continue
            fields = {k: r[k] for k in ("subject", "model", "check", "family", "case")}
            candidates = [f for f in faults if f.matches_fields(**fields) and f.shown_by(r["message"])]
            # the entry that applies on that release; else the first by fields (bounds still to be fixed)
            fault = next((f for f in candidates if f.applies_to(version)), candidates[0] if candidates else None)
            if fault is not None:
                seen.setdefault(fault.id, []).append(r.get("metrics") or {})
    out, steps_seen = {}, {}
    for fault_id, failures in seen.items():
        env, values, ok = {}, {}, True
        for m in failures:
            described = False
            for key in ("max_abs", "bytes_ratio"):
                v = metric(m, key)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    env[key] = max(env.get(key, 0.0), float(v))
                    described = True
            if m.get("raised"):
                values.setdefault("raised", set()).add(str(m["raised"]))
                described = True
            if m.get("failed_at") is not None:
                values.setdefault("failed_at", set()).add(str(m["failed_at"]))
            if not described:
                for key in ENVELOPE_KEYS:
                    if key in m:
                        v = m[key]
                        values.setdefault(key, set()).update(map(str, v if isinstance(v, list) else [v]))
                        described = True
            ok &= described
        if not ok:
            out[fault_id] = None
            continue
        table = {}
        if "max_abs" in env:
            table["max_abs"] = float(f"{max(2 * env['max_abs'], 1e-3):.2g}")
        if "bytes_ratio" in env:
            table["bytes_ratio"] = float(f"{1.5 * env['bytes_ratio']:.2g}")
        steps = values.pop("failed_at", set())
        for key, vals in values.items():
            if vals:
                table[key] = "^(" + "|".join(re.escape(v).replace("\\ ", " ") for v in sorted(vals)) + ")$"
        out[fault_id] = table
        steps_seen[fault_id] = sorted(steps)
    return out, steps_seen


def toml_table(table: dict) -> str:
    """``{ key = value, ... }`` (inline TOML) for an envelope."""
    parts = []
    for key, value in table.items():
        parts.append(f"{key} = {json.dumps(value, ensure_ascii=False)}" if isinstance(value, str) else
                     f"{key} = {value!r}")
    return "{ " + ", ".join(parts) + " }"


def _first_line(message: str) -> str:
    for line in message.splitlines():
        if line.startswith("E ") or "Error" in line:
            return line.strip()[:160]
    return (message.strip().splitlines() or [""])[-1][:160]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", default=None, help=f"releases (default: {' '.join(RELEASES)})")
    parser.add_argument("--all", action="store_true", help=f"every release pip lists in {SUPPORTED}")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "kvconform-tf"),
                        help="folder for the --target installs (kept between sweeps)")
    parser.add_argument("--out", default="kvconform-sweep", help="folder for the reports, logs and sweep.md")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. '-n 2' or "
                                                           "'--kvconform-model llama'")
    parser.add_argument("--from-reports", action="store_true",
                        help="reuse the JSON reports already in --out (re-judge them against the current "
                             "known_faults.toml without running again)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from kvconform.known_faults import load_all

    versions = all_releases() if args.all else (args.versions or list(RELEASES))
    cache, out = Path(args.cache), Path(args.out)
    cache.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    faults = load_all()
    rows, green, results, reports = [], True, {}, []
    for version in versions:
        try:
            target = None if args.from_reports else install(version, cache)
        except (RuntimeError, StopIteration) as exc:
            print(f"error: cannot install transformers {version}: {exc}", file=sys.stderr)
            return 4
        report = out / f"kvconform-{version}.json"
        if args.from_reports and report.exists():
            data = json.loads(report.read_text(encoding="utf-8"))
            data["seconds"] = float("nan")
        else:
            data = run_release(version, target, out, shlex.split(args.pytest_args))
        reports.append(data)
        result = classify(data, faults)
        results[version] = result
        counts = {o: sum(1 for r in data["results"] if r["outcome"] == o) for o in
                  ("passed", "failed", "error", "skipped", "xfailed")}
        xpass = sum(v["xpass"] for v in result["per_fault"].values())
        held = sum(v["held"] for v in result["per_fault"].values())
        ok = not result["unlisted"] and not xpass
        green &= ok
        rows.append((version, data["seconds"], counts, held, xpass, len(result["unlisted"]), ok))
        print(f"transformers {version}: {data['seconds']:.0f}s, {held} known-fault failures, {xpass} XPASS, "
              f"{len(result['unlisted'])} unlisted -> {'green' if ok else 'RED'}", flush=True)
    lines = ["# kvconform release sweep", "", "| transformers | seconds | items run | known faults (xfail) | XPASS "
             "| unlisted failures | default run |", "|---|---|---|---|---|---|---|"]
    for version, seconds, counts, held, xpass, unlisted, ok in rows:
        ran = counts["passed"] + counts["failed"] + counts["error"] + counts["xfailed"]
        lines.append(f"| {version} | {seconds:.0f} | {ran} | {held} | {xpass} | {unlisted} | "
                     f"{'green' if ok else 'RED'} |")
    lines += ["", "## Per entry (items: held / XPASS / failing outside its bounds)", "",
              "| entry | transformers | " + " | ".join(versions) + " |", "|---|---|" + "---|" * len(versions)]
    for f in faults:
        cells = []
        for v in versions:
            c = results[v]["per_fault"][f.id]
            cells.append("-" if not any(c.values()) else f"{c['held']}/{c['xpass']}/{c['outside']}")
        lines.append(f"| {f.id} | `{f.transformers}` | " + " | ".join(cells) + " |")
    lines += ["", "## Unlisted failures", ""]
    for v in versions:
        for r in results[v]["unlisted"]:
            lines.append(f"- {v}: `{r['subject']} · {r['model']} · {r['check']} · {r['case']}`: "
                         f"{_first_line(r['message'])}")
    envelopes, steps = measure_envelopes(reports, faults)
    lines += ["", "## Measured envelopes (what each entry's failures measure on the built-in subjects, with margin)",
              ""]
    for f in faults:
        if f.id in envelopes:
            table = envelopes[f.id]
            lines.append(f"- {f.id}: " + ("(some failure has no Δ, bytes, exception or contract metric)"
                                          if table is None else f"`envelope = {toml_table(table)}`")
                         + (f"; fails at: {', '.join(steps[f.id])}" if steps.get(f.id) else ""))
    (out / "sweep.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "envelopes.json").write_text(json.dumps(envelopes, indent=1), encoding="utf-8")
    print(f"wrote {out / 'sweep.md'}")
    return 0 if green else 1


if __name__ == "__main__":
    sys.exit(main())
