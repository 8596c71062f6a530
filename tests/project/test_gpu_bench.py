"""``kvconform-gpu-bench`` (kvconform/gpu_bench.py): its CPU smoke mode runs every code path of the benchmark at tiny
size — cached decode under the installed transformers' cache keyword, compile with recompile counting, interleaved
timing, counted cache bytes — in seconds; in a subprocess, so that dynamo's state never leaks into other tests."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_console_script_is_declared_and_resolves_to_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["kvconform-gpu-bench"].partition(":")
    import importlib

    assert getattr(importlib.import_module(module), attr) is importlib.import_module("kvconform.gpu_bench").main


def test_smoke_run_covers_every_target_and_writes_the_report(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "kvconform.gpu_bench", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "smoke run (no budgets on CPU)" in proc.stdout
    report = json.loads(out.read_text())
    import transformers
    from packaging.version import Version

    assert report["size"] == "tiny" and report["device"] == "cpu" and report["backend"] == "eager"
    assert report["transformers"] == transformers.__version__
    newest = Version(report["transformers"]) >= Version("5.24")
    assert report["cache_kwarg"] == ("cache" if newest else "past_key_values")
    targets = {f"{name}@{c}" for name in ("DynamicCache", "StaticCache", "StaticCache+compile", "uncached")
               for c in report["contexts"]}
    assert set(report["ms_per_token"]) == targets and all(v > 0 for v in report["ms_per_token"].values())
    # a full-attention StaticCache decodes under one compiled graph
    assert report["compile"]["recompiles"] == 0 and report["compile"]["cudagraph_skips"] == 0
    # the decode filled the caches it was given (checked inside the bench too) and they hold exactly the formula
    # (a StaticCache adds only its small length-bookkeeping tensors)
    assert report["memory"]["DynamicCache"]["ratio_counted_formula"] == 1.0
    assert 1.0 <= report["memory"]["StaticCache"]["ratio_counted_formula"] < 1.01
    assert {"DynamicCache counted bytes == formula", "recompiles after warm-up",
            "StaticCache+compile vs DynamicCache eager @16",
            "StaticCache+compile / floor @32"} <= set(report["budgets"])
    # every speed is also given against this device's floor (bytes read per token over its memory bandwidth); cached
    # vs uncached is reported, never judged by a threshold born on a CPU
    assert report["complete"] and report["sections"] == ["memory", "eager speed", "compile", "compiled speed"]
    assert set(report["floor_ratio"]) == targets - {f"uncached@{c}" for c in report["contexts"]}
    assert all(v > 0 for v in report["floor"]["ms_per_token"].values())
    assert report["floor"]["bandwidth_bytes_per_s"] > 0 and report["floor"]["bandwidth_source"]
    assert "ok" not in report["budgets"][f"DynamicCache vs uncached @{report['contexts'][-1]}"]


def test_the_report_is_emitted_after_each_section():
    code = ("import json; from kvconform.gpu_bench import run_gpu_bench\n"
            "run_gpu_bench(size='tiny', device='cpu', contexts=(8, 16), steps=1, repeats=1, warmup=0, backend='eager',"
            " emit=lambda r: print('EMIT', json.dumps(r['sections'])))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    emitted = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("EMIT ")]
    assert emitted == [["memory"], ["memory", "eager speed"], ["memory", "eager speed", "compile"],
                       ["memory", "eager speed", "compile", "compiled speed"]]


def test_without_cuda_the_benchmark_skips_with_its_reason():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the skip path is for CPU-only machines")
    proc = subprocess.run([sys.executable, "-m", "kvconform.gpu_bench"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("SKIP: kvconform-gpu-bench requires CUDA"), proc.stdout


def test_bad_contexts_is_a_usage_error(capsys):
    from kvconform.gpu_bench import main

    with pytest.raises(SystemExit) as exc:
        main(["--contexts", "512,long"])
    assert exc.value.code == 2
    assert "--contexts '512,long': expected comma-separated integers" in capsys.readouterr().err
