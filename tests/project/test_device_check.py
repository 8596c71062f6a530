"""The prepared GPU check (``kvconform-device-check``): without CUDA it is a usage error naming the smoke mode; its
steps and their limits fit the 8-minute GPU budget; its summary of a conformance report counts what the report holds
and lists the GPU-bound skips (the lane that did not run). The smoke run itself runs in CI (.ci/run, stage 5)."""

import pytest
import torch

from kvconform import device_check


def test_steps_fit_eight_minutes_on_one_gpu():
    assert [s.name for s in device_check.STEPS] == ["conformance", "gpu_bench"]
    assert sum(s.timeout_s for s in device_check.STEPS) <= 8 * 60


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA refusal needs a machine without CUDA")
def test_without_cuda_it_is_a_usage_error_naming_the_smoke_mode(tmp_path, capsys):
    assert device_check.main(["--out", str(tmp_path / "r.json")]) == 4
    assert "--smoke" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_commands_run_the_default_tier_on_cuda_and_a_small_cpu_subset_in_smoke(tmp_path):
    cuda = device_check.conformance_command(False, tmp_path / "c.json")
    assert cuda[cuda.index("--kvconform-device") + 1] == "cuda" and "-k" not in cuda
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
