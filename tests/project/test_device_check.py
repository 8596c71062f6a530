"""The prepared GPU check (``kvconform-device-check``): without CUDA it is a usage error naming the smoke mode; its
steps and their limits fit one 10-minute call; it starts from a clone on a relative ``PYTHONPATH`` run from another
folder (no install, no build step: a bare GPU box without a registry), its steps importing that clone; its summary of
a conformance report counts what the report holds and lists the GPU-bound skips (the lane that did not run). The
whole smoke run runs in CI (.ci/run, stage 5)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvconform import device_check

ROOT = Path(__file__).resolve().parents[2]


def test_steps_fit_one_ten_minute_call():
    assert [s.name for s in device_check.STEPS] == ["preflight", "plan", "conformance", "gpu_bench"]
    assert sum(s.timeout_s for s in device_check.STEPS) <= device_check.BUDGET_S <= 10 * 60 - 60


def test_the_documented_launch_from_a_clone_works_from_another_folder(tmp_path):
    """``PYTHONPATH=<clone> python -m kvconform.device_check``, the path relative and the command run elsewhere: the
    steps, which run in a temporary folder, import this clone (its absolute path is what they get)."""
    run_in = tmp_path / "elsewhere"
    run_in.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env["PYTHONPATH"] = os.path.relpath(ROOT, run_in)
    proc = subprocess.run([sys.executable, "-m", "kvconform.device_check", "--smoke", "--steps", "preflight",
                           "--out", "report.json"], cwd=run_in, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((run_in / "report.json").read_text())
    assert report["complete"] and report["mode"] == "smoke" and report["steps"][0]["exit_code"] == 0
    assert report["preflight"]["kvconform"] == str(ROOT / "kvconform" / "__init__.py"), report["preflight"]
    assert report["environment"]["kvconform"] == str(ROOT)


def test_every_step_gets_the_clone_first_on_an_absolute_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "relative/elsewhere")
    paths = device_check.step_env(smoke=False)["PYTHONPATH"].split(os.pathsep)
    assert paths[0] == str(ROOT) and os.path.isabs(paths[0]) and "relative/elsewhere" in paths


def test_a_step_past_its_limit_is_ended_with_its_process_group_and_recorded(tmp_path):
    # a step whose child outlives it (as pytest's xdist workers would): both end at the limit
    child = tmp_path / "child.pid"
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(60)']); open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    step = device_check.Step("slow", 2, 2)
    record = device_check.run_step(step, [sys.executable, "-c", code], True, str(tmp_path), limit=2)
    assert record["timed_out"] and record["exit_code"] == 124 and record["wall_s"] < 30
    pid = int(child.read_text())
    import time

    for _ in range(50):  # the grandchild was killed with the group (a zombie until its parent is reaped)
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "Z"
            if state == "Z":
                break
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's child {pid} outlived its limit")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA refusal needs a machine without CUDA")
def test_without_cuda_it_is_a_usage_error_naming_the_smoke_mode(tmp_path, capsys):
    assert device_check.main(["--out", str(tmp_path / "r.json")]) == 4
    assert "--smoke" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_commands_run_the_default_tier_on_cuda_and_a_small_cpu_subset_in_smoke(tmp_path):
    cuda = device_check.conformance_command(False, tmp_path / "c.json")
    assert cuda[cuda.index("--kvconform-device") + 1] == "cuda" and cuda[cuda.index("-k") + 1] == "not quanto"
    assert cuda[cuda.index("--kvconform-timeout") + 1] == str(device_check.ITEM_TIMEOUT_S)
    assert "-k" not in device_check.conformance_command(False, tmp_path / "c.json", with_quanto=True)
    smoke = device_check.conformance_command(True, tmp_path / "c.json")
    assert "--kvconform-device" not in smoke and "bf16_decode_padded" in smoke[smoke.index("-k") + 1]
    assert device_check.bench_command(True, tmp_path / "b.json")[-1] == "--smoke"


def test_summary_counts_outcomes_dtypes_failures_and_gpu_bound_skips():
    records = [
        {"nodeid": "a", "outcome": "passed", "dtype": "bfloat16", "message": ""},
        {"nodeid": "b", "outcome": "failed", "dtype": "float16", "message": "check_x failed: S on llama\n  detail"},
        {"nodeid": "c", "outcome": "skipped", "dtype": "float32",
         "message": "mamba-ssm kernels need CUDA and the [mamba] extra (pip install kvconform[mamba])"},
        {"nodeid": "d", "outcome": "skipped", "dtype": "float32", "message": "DynamicCache declares crop"},
    ]
    summary = device_check.summarize_conformance({"results": records, "complete": True})
    assert summary["items"] == 4 and summary["outcomes"] == {"passed": 1, "failed": 1, "skipped": 2}
    assert summary["dtypes"] == {"bfloat16": 1, "float16": 1, "float32": 2}
    assert summary["failures"] == [{"id": "b", "first_line": "check_x failed: S on llama"}]
    assert list(summary["gpu_bound_skips"]) == [records[2]["message"]]  # the crop skip is not GPU-bound
