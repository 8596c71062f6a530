"""The plan's position rule (``plan.position_limit`` / ``positions_problem``): a model's limit is read from its
config — a learned position table's rows, confirmed on the meta device — never found by running a forward that is
expected to raise (on CUDA an out-of-range lookup is a device-side assert that fails every later CUDA call of the
worker, each blamed on a cache). Every built-in case × zoo model fits, CUDA-only cases included; a case that does
not fit is skipped with the reason before anything runs."""

import pytest

from kvconform import compat, zoo
from kvconform.plan import model_info, position_limit, positions_needed, positions_problem


def test_limits_come_from_learned_position_tables_in_the_configs():
    limits = {name: position_limit(model_info(name, zoo_only=True, read_forward=False)) for name in zoo.ALL_NAMES}
    assert limits["gpt2"] == 512 and limits["bart"] == 512  # n_positions / max_position_embeddings: tables
    assert limits["whisper"] == 512  # its decoder's table (max_target_positions), not the encoder's 10 states
    # rotary models (llama ... and the VLMs' text models), relative buckets (t5), states (mamba) have no limit;
    # jamba declares max_position_embeddings = 512 but has no position table (its attention takes no positions)
    assert {name for name, limit in limits.items() if limit is not None} == {"gpt2", "bart", "whisper"}, limits


@pytest.fixture(scope="module")
def cuda_plan():
    """Every built-in subject × case × model of the full tier, planned for CUDA without a GPU."""
    from kvconform.session import build_session

    with compat.planned_as_cuda():
        session = build_session(device="cuda", full=True, models=list(zoo.ALL_NAMES))
        return session.items()


def test_every_builtin_case_fits_every_model_it_plans_cuda_only_cases_included(cuda_plan):
    too_long = [(item.id, positions_problem(item.model, item.check, item.case)) for item in cuda_plan
                if positions_problem(item.model, item.check, item.case)]
    assert not too_long, too_long
    # the CUDA-only items are in that plan (offloading, CUDA graphs), gpt2's offload case among them
    offload = [i for i in cuda_plan if i.case.id == "offload_decode" and i.model.name == "gpt2"]
    assert offload and positions_needed(offload[0].case, offload[0].check) <= 512


def test_a_case_longer_than_a_models_table_is_skipped_with_the_reason_before_it_runs(tmp_path):
    from kvconform.session import build_session

    # the offload case as it was (prefill 512 + decode 8 on gpt2: an IndexError on CPU, a device-side assert on CUDA)
    (tmp_path / "long.toml").write_text(
        '[[case]]\nid = "offload_decode_520"\ncheck = "check_offloaded_matches"\nmodels = ["llama", "gpt2"]\n'
        'ops = ["prefill 512", "decode 8"]\nparams = { layers = 6 }\n\n'
        '[[case]]\nid = "decode_520"\ncheck = "check_prefill_then_decode"\nops = ["prefill 512", "decode 8"]\n')
    with compat.planned_as_cuda():
        session = build_session(models=["gpt2", "llama"], case_paths=[str(tmp_path)], device="cuda",
                                case_ids=["offload_decode_520", "decode_520"])
        items = session.items()
    by_model: dict = {}
    for item in items:
        by_model.setdefault(item.model.name, set()).add(item.skip or "runs")
    assert by_model["gpt2"] >= {"gpt2 takes at most 512 positions (its config: a learned position table) and case "
                                "offload_decode_520 makes it see 520 tokens"}, by_model["gpt2"]
    assert all(not (item.skip or "").startswith("gpt2 takes") for item in items if item.model.name == "llama")
    assert "runs" in by_model["llama"] and "runs" not in by_model["gpt2"]


def test_a_fixed_position_buffer_is_a_limit_too():
    # CTRL keeps a sinusoidal table of n_positions rows as a buffer (pos_encoding) and indexes it by position: a
    # 260-token case on its 256 positions raised IndexError inside the model (every-architecture sweep, 5.25)
    from kvconform.plan import ModelInfo

    ctrl = ModelInfo("tf_ctrl", "transformers:ctrl", ("full_attention",), False, True)
    assert position_limit(ctrl) == 256
