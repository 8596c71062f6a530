"""Users' checkpoints of architectures outside the zoo get every family that applies to their kind of model in the
default run, the header says what was left out and why, and known faults of their kind apply to them."""

import json
import subprocess
import sys
import textwrap

import torch  # noqa: F401 - before pytester snapshots sys.modules (see test_plugin.py)

SAVE = textwrap.dedent("""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.1)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", head_dim=16, **common)).save_pretrained("qwen3")
    AutoModelForCausalLM.from_config(AutoConfig.for_model("lfm2", layer_types=["conv", "full_attention"], **common)
                                     ).save_pretrained("lfm2")
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **common)).save_pretrained("llama_saved")
""")


def _records(pytester, name):
    return json.loads((pytester.path / name).read_text())["results"]


def test_checkpoints_of_other_architectures_get_the_families_of_their_kind(run_kvconform, pytester):
    # saved in a subprocess: save_pretrained imports torch modules lazily, and pytester drops modules imported
    # during a test
    subprocess.run([sys.executable, "-c", SAVE], cwd=pytester.path, check=True, capture_output=True)
    select = "(ReferenceCache or DynamicCache) and not offloaded and not speed"
    result = run_kvconform("--kvconform-model", "./llama_saved", "--kvconform-model", "llama",
                           "--kvconform-model", "./qwen3", "--kvconform-model", "./lfm2", "-k", select,
                           "--kvconform-json", "r.json")
    out = result.stdout.str()
    assert "kvconform checkpoint qwen3 (attention, decoder_only):" in out
    assert "kvconform checkpoint lfm2 (attention, decoder_only, linear_attention):" in out
    assert "for other kinds of model" in out and "for the full tier" in out
    records = _records(pytester, "r.json")

    def items(model, subject="ReferenceCache"):
        return {(r["check"], r["case"]): r["outcome"] for r in records if r["model"] == model and
                r["subject"] == subject}

    # a saved llama gets exactly the zoo llama's items, with the same outcomes — but the subject as the draft's cache:
    # the draft of a model outside the zoo is the zoo's llama, whose cache the subject would be built for a model it
    # was not built for, so that role skips there, saying so
    draft_role = ("check_speculative_greedy", "assisted_draft_cache")
    assert items("llama")[draft_role] == "passed"
    for model in ("llama_saved", "qwen3"):
        assert items(model).pop(draft_role) == "skipped"
        assert {**items(model), draft_role: "passed"} == items("llama") and len(items("llama")) > 20
    families = {r["family"] for r in records if r["model"] == "qwen3"}
    assert {"logits", "generate", "crop", "prefix", "batch", "lifecycle", "contract", "fuzz"} <= families
    # the reference conforms on both; DynamicCache on qwen3 too
    for model in ("qwen3", "lfm2"):
        assert set(items(model).values()) <= {"passed", "xfailed", "skipped"}, items(model)
        assert "passed" in set(items(model).values())
    assert set(items("qwen3", "DynamicCache").values()) <= {"passed", "xfailed", "skipped"}
    assert any(r["family"] in ("logits", "prefix") for r in records if r["model"] == "lfm2")
    # LFM2's conv layers are transformers' LinearAttentionLayer, which (5.24) has no batch_repeat_interleave /
    # batch_select_indices: a real upstream gap, reported on DynamicCache's contract item, not hidden
    lfm2_dynamic = {k: v for k, v in items("lfm2", "DynamicCache").items() if v == "failed"}
    assert set(lfm2_dynamic) <= {("check_api_contract", "api_surface")}, lfm2_dynamic
