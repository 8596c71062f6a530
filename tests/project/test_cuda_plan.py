"""What a GPU run would plan, skip and judge, and by which budget: the default tier planned for
``--kvconform-device cuda`` on this CPU (``compat.planned_as_cuda``; ``kvconform-device-check``'s plan step), read
through ``device_check.plan_summary``. The GPU lane (offloaded caches, CUDA-only cases, ``memory_allocated``) is
planned; what a CPU-calibrated budget would misjudge on a GPU (speed ratios on launch-bound tiny models) and what a
subject cannot do there (fork an offloaded cache, compile one) skips with its reason, before anything runs."""

import pytest

from kvconform import compat, device_check
from kvconform.subjects.builtin import OFFLOAD_COMPILE_NOTE


@pytest.fixture(scope="module")
def plans():
    from kvconform.session import build_session

    cpu = build_session(device="cpu").items()
    with compat.planned_as_cuda():
        cuda = build_session(device="cuda").items()
    return {i.id: i for i in cpu}, {i.id: i for i in cuda}


def test_the_gpu_lane_is_planned_on_cuda_and_skipped_on_cpu(plans):
    cpu, cuda = plans
    assert set(cpu) == set(cuda)  # the same items: only their skips differ
    lane = [i for i in cuda if cpu[i].skip and not cuda[i].skip]
    # the offloaded caches' items, the CUDA-only cases, the allocator check
    assert {"DynamicCache_offloaded-gpt2-offloaded_matches-offload_decode",
            "StaticCache_offloaded-llama-offloaded_matches-offload_decode",
            "StaticCache-llama-speed_compiled_static-speed_compiled_static_cuda",
            "StaticCache-llama-compile_static_decode-compile_cudagraphs",
            "DynamicCache-llama-memory_cuda_allocated-memory_cuda_allocated"} <= set(lane), sorted(lane)[:20]
    assert all(cpu[i].skip in ("offloading needs CUDA",) or "CUDA" in cpu[i].skip for i in lane)
    # nothing is left skipped for want of CUDA, but mamba-ssm's kernels where the package is not installed
    left = {cuda[i].skip for i in cuda if cuda[i].skip and ("requires CUDA" in cuda[i].skip
                                                             or "needs CUDA" in cuda[i].skip)}
    assert left <= {"mamba-ssm kernels need CUDA and the [mamba] extra (pip install kvconform[mamba])"}, left


def test_what_a_gpu_cannot_judge_or_a_subject_cannot_do_skips_with_its_reason(plans):
    cpu, cuda = plans
    speed = {i: cuda[i].skip for i in cuda if cuda[i].check.family == "speed" and not cpu[i].skip}
    assert speed  # the CPU-calibrated speed items: launch-bound on a GPU, skipped with the floors' numbers
    for item_id, skip in speed.items():
        assert skip and "launch-bound" in skip and "kvconform-gpu-bench" in skip, (item_id, skip)
    for name in ("DynamicCache_offloaded", "StaticCache_offloaded"):
        forks = [cuda[i] for i in cuda if i.startswith(f"{name}-") and "deepcopy" in cuda[i].check.needs]
        assert forks and all("torch.Stream" in i.skip for i in forks if "capability 'deepcopy'" in (i.skip or ""))
        compiled = [cuda[i] for i in cuda if i.startswith(f"{name}-")
                    and cuda[i].check.name in ("check_static_addresses", "check_compile_static_decode")]
        assert all(OFFLOAD_COMPILE_NOTE in (i.skip or "") for i in compiled), [(i.id, i.skip) for i in compiled]


def test_the_summary_names_each_judged_gpu_budget(plans):
    _, cuda = plans
    summary = device_check.plan_summary(list(cuda.values()))
    assert summary["items"] == len(cuda) and summary["run"] + summary["skipped"] == len(cuda)
    graphs = summary["judged_budgets"]["check_speed_compiled_static:speed_compiled_static_cuda"]
    assert graphs["budget"] == {"device": "cuda", "min_speedup": 1.5, "mode": "reduce-overhead"}
    assert sorted(graphs["items"]) == ["StaticCache-gemma3", "StaticCache-llama", "StaticCache-mistral"]
    allocated = summary["judged_budgets"]["check_memory_cuda_allocated:memory_cuda_allocated"]
    assert allocated["budget"] == {"cuda_slack_bytes": 1 << 20} and "StaticCache_offloaded-gpt2" in allocated["items"]
    assert not any(key.startswith("check_speed_vs_uncached") for key in summary["judged_budgets"])


def test_quanto_on_cuda_needs_nvcc(plans, monkeypatch, tmp_path):
    from kvconform.plan import skip_reason

    _, cuda = plans
    item = next(i for i in cuda.values() if i.subject.name == "QuantizedCache_quanto4" and not i.skip)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    with compat.planned_as_cuda():
        reason = skip_reason(item.subject, item.model, item.check, item.case, "cuda")
    assert reason and reason.startswith("requires nvcc on CUDA (optimum-quanto builds its CUDA kernels"), reason
    assert skip_reason(item.subject, item.model, item.check, item.case, "cpu") is None
