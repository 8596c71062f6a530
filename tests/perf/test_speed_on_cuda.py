"""The speed family on CUDA (``checks/speed.cuda_speed_problem``), planned without a GPU: a budget calibrated on a
CPU is judged on CUDA only where a decode step is bound by reading the model's weights, not by launching its
kernels — the zoo's tiny models skip with the two floors in the reason, a 7B-parameter model is judged; a case
written for CUDA (``params.device = "cuda"``) is always judged there, and nothing changes on CPU."""

import json

import pytest

from kvconform import compat
from kvconform.cases import load_cases
from kvconform.checks.speed import cuda_speed_problem
from kvconform.plan import ModelInfo, model_info
from kvconform.timing import FASTEST_BANDWIDTH, decode_floor_s, launch_floor_s

LLAMA_7B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def cases():
    return {c.id: c for c in load_cases()}


def test_the_zoo_is_launch_bound_on_any_gpu_and_skips_with_both_floors(cases):
    llama = model_info("llama", zoo_only=True, read_forward=False)
    with compat.planned_as_cuda():
        reason = cuda_speed_problem(llama, cases["speed_vs_uncached"], "cuda")
    assert reason and reason.startswith("on CUDA llama is launch-bound: a decode step reads 0.36 MB of weights"), reason
    assert "at 8 TB/s" in reason and "kvconform-gpu-bench" in reason
    # floors: 0.36 MB at the fastest memory is 45 ns; two layers' launches are 120 µs
    assert decode_floor_s(0.36e6, FASTEST_BANDWIDTH) < launch_floor_s(2) / 1000


def test_a_seven_billion_parameter_model_is_judged_by_the_case_budget(cases, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    big = ModelInfo("llama7b", str(tmp_path), ("full_attention",), False, True)
    with compat.planned_as_cuda():
        # float32 weights: 27 GB, 3.4 ms at 8 TB/s, over the 1.9 ms of launching 32 layers' kernels
        assert cuda_speed_problem(big, cases["speed_vs_uncached"], "cuda") is None
        assert cuda_speed_problem(big, cases["speed_flat_decode"], "cuda") is None


def test_cuda_cases_and_cpu_runs_are_untouched(cases):
    llama = model_info("llama", zoo_only=True, read_forward=False)
    with compat.planned_as_cuda():
        assert cuda_speed_problem(llama, cases["speed_compiled_static_cuda"], "cuda") is None  # written for CUDA
    assert cuda_speed_problem(llama, cases["speed_vs_uncached"], "cpu") is None
