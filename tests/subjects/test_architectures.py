"""transformers:PATTERN: architectures of the installed transformers built tiny from their own config classes,
refused with a true reason when they cannot be checked (a bidirectional encoder, a forward without a cache), run
like any model otherwise. A handful of architectures, direct API calls: cheap."""

import pytest

from kvconform.outcomes import UsageError


def test_a_bidirectional_encoder_and_a_cacheless_model_are_refused_with_their_reason():
    from kvconform import sweep
    from kvconform.session import CAUSALITY_TOLERANCE, causality_gap

    xlm = sweep.examine("xlm", causality_gap, CAUSALITY_TOLERANCE)  # XLMWithLMHeadModel: an MLM encoder
    assert not xlm["built"] and xlm["reason"].startswith("not causal: changing later input tokens changed")
    gpt = sweep.examine("openai-gpt", causality_gap, CAUSALITY_TOLERANCE)
    assert not gpt["built"] and "takes no cache" in gpt["reason"]
    # the same family as a decoder (is_decoder=True, what its causal-LM class asks for) is causal and built
    bert = sweep.examine("bert", causality_gap, CAUSALITY_TOLERANCE)
    assert bert["built"] and bert["gap"] <= CAUSALITY_TOLERANCE, bert


def test_generic_shrink_keeps_one_layer_of_each_type_and_sub_configs_small():
    from kvconform import architectures

    gemma3 = architectures.tiny_config("gemma3_text")  # 5 sliding layers per full one in its defaults
    assert gemma3.hidden_size == 64 and gemma3.vocab_size == 256
    assert sorted(set(gemma3.layer_types)) == ["full_attention", "sliding_attention"]
    assert gemma3.num_hidden_layers == len(gemma3.layer_types) == 2
    qwen35 = architectures.tiny_config("qwen3_5")  # a composite config: its LM class takes the text config
    assert qwen35.hidden_size == 64 and {"linear_attention", "full_attention"} <= set(qwen35.layer_types)
    # a hybrid keeps one of its attention layers: kimi_linear's MLP types alone would pick two linear layers, and
    # granitemoehybrid's default stack is all linear attention (its own cached forward then raises)
    kimi = architectures.tiny_config("kimi_linear")
    assert kimi.layer_types == ["linear_attention", "linear_attention", "full_attention"], kimi.layer_types
    granite = architectures.tiny_config("granitemoehybrid")
    assert granite.layer_types == ["linear_attention", "full_attention"], granite.layer_types
    with pytest.raises(UsageError, match="no causal-LM architecture of transformers matches 'nosuch\\*'"):
        architectures.model_types("nosuch*")


def test_a_pattern_becomes_models_listed_in_the_header_and_report_and_runs_like_any_model():
    from kvconform.checks import ConformanceError
    from kvconform.session import build_session

    session = build_session(models=["transformers:gpt*", "llama"], only_subjects=["DynamicCache"],
                            case_ids=["decode_explicit_positions"])
    names = [m.name for m in session.models]
    assert names[-1] == "llama" and {"tf_gpt2", "tf_gpt_neox", "tf_gptj"} <= set(names)
    header = "\n".join(session.header_lines())
    tried = session.environment()["architectures"]
    assert len(tried) == sum(1 for line in header.splitlines() if line.startswith("  tf_gpt"))
    assert "tf_gpt2: built (attention, decoder_only; layers full_attention/full_attention)" in header
    assert all(r["built"] or r["reason"] for r in tried)
    ran = 0
    for item in session.items():
        if item.skip or item.model.name not in ("tf_gpt2", "tf_gpt_neox"):
            continue
        try:
            session.run(item)
        except ConformanceError as exc:  # a failure here must be a known fault, never silence
            assert item.xfail, str(exc)
        ran += 1
    assert ran >= 2
