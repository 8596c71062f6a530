"""A left-padded batch is judged row by row against the same row alone. That equivalence is the model's to give:
a model whose positions come from the slot (learned absolute positions it offsets by itself, or a forward that
honours no 0-based ``position_ids``) gives a padded row other logits whatever the cache, so its padded items skip
with the measured gap instead of failing every cache, the reference included (issue: every architecture at every
dtype). The oracle passes ``position_ids`` exactly where the cached forward does."""

import torch

from kvconform import zoo
from kvconform.oracle import Oracle


def _oracle(spec):
    return Oracle(zoo.load_model(spec, dtype=torch.float32))


def test_a_model_placing_a_padded_row_by_slot_has_a_gap_and_one_taking_positions_has_none():
    # llama takes 0-based position_ids; t5 (encoder-decoder) is never left-padded: no verdict
    assert _oracle("llama").left_padding_gap() is None
    assert _oracle("gpt2").left_padding_gap() is None
    assert _oracle("t5").left_padding_gap() is None
    # BART's decoder as a causal LM: learned positions offset by 2, no position_ids: the padded row moves by ~3 logits
    bart = _oracle("transformers:bart")
    gap = bart.left_padding_gap()
    assert gap is not None and gap > 0.1, gap
    # measured by the oracle's own forwards, as the runner feeds them: the row alone vs after two pads, with the mask
    toks = torch.arange(3, 9).unsqueeze(0)
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), toks], 1)
    mask = torch.tensor([[0, 0] + [1] * 6])
    again = float((bart.logits(toks) - bart.logits(padded, attention_mask=mask)[:, 2:]).abs().max())
    assert again == gap


def test_padded_items_of_such_a_model_skip_with_the_gap_and_run_elsewhere(run_kvconform, pytester):
    result = run_kvconform("--kvconform-model", "transformers:bart", "--kvconform-model", "transformers:roformer",
                           "--kvconform-model", "llama",
                           "--kvconform-subject", "DynamicCache", "-k", "decode_padded", "--kvconform-json", "r.json",
                           "-n", "0")
    import json

    records = json.loads((pytester.path / "r.json").read_text())["results"]
    bart = [r for r in records if r["model"] == "tf_bart" and r["subject"] == "DynamicCache"]
    llama = [r for r in records if r["model"] == "llama" and r["subject"] == "DynamicCache"]
    assert bart and all(r["outcome"] == "skipped" and "puts a left-padded row" in r["message"]
                        and "no unpadded equivalent" in r["message"] for r in bart), bart
    assert llama and all(r["outcome"] in ("passed", "xfailed") for r in llama), llama
    # RoFormer's gap (~1e-3 at bfloat16, ~2e-4 at float16) is under the items' smallest bound: they run, and pass
    roformer = [r for r in records if r["model"] == "tf_roformer" and r["subject"] == "DynamicCache"]
    assert roformer and all(r["outcome"] == "passed" for r in roformer), roformer
    assert result.ret == 0
