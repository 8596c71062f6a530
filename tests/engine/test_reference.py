"""ReferenceCache against the float64 uncached oracle, on every zoo family (plain pytest, no plugin).

Known transformers faults these tests step around (they are not ReferenceCache bugs):
- Mamba (v1) and Jamba drop the recurrent state when more than one token is fed into a warm cache, so after the
  prefill they are only ever fed one token at a time here.
- Bamba without explicit ``position_ids`` puts decode tokens at position 0, so explicit positions are always passed.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache

from kvconform.reference import (
    ReferenceAttentionLayer,
    ReferenceCache,
    ReferenceHybridLayer,
    ReferenceLinearAttentionLayer,
)
from kvconform.zoo import ZOO_NAMES, build_zoo_model

PROMPT, DECODE = 12, 8
TOL_ORACLE = 2e-5  # measured: 7e-7 … 2e-6 for every family in fp32
TOL_DYNAMIC = 5e-6  # measured: 0 (identical ops) … 1.1e-6 (sliding layers, where DynamicCache holds fewer keys)
CHUNKED_UNSAFE = ("mamba", "jamba")  # lose the recurrent state on k>1 tokens into a warm cache (transformers)


@functools.lru_cache(maxsize=None)
def zoo(name):
    """(ZooModel in fp32, the same weights in float64 for the oracle)."""
    zm = build_zoo_model(name)
    oracle_model = copy.deepcopy(zm.model).double()
    if name == "jamba":  # grouped_mm (the default MoE experts kernel) rejects float64
        oracle_model.set_experts_implementation("eager")
    return zm, oracle_model


def tokens(batch, length, seed):
    # ids >= 3: 0/1/2 are pad/bos/eos, and a pad id in the prompt would make generate() build a padding mask.
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def encoder_ids(batch):
    return tokens(batch, 10, seed=99)


def new_cache(zm, kind="reference"):
    if zm.is_encoder_decoder:
        if kind == "reference":
            return EncoderDecoderCache(ReferenceCache(), ReferenceCache())
        return EncoderDecoderCache(DynamicCache(config=zm.config), DynamicCache(config=zm.config))
    return ReferenceCache(config=zm.config) if kind == "reference" else DynamicCache(config=zm.config)


@torch.no_grad()
def forward(zm, model, ids, cache=None, start=0):
    """Logits ``[batch, len, vocab]`` of ``ids`` fed at positions ``start…``; uncached when ``cache`` is None."""
    kwargs = dict(cache=cache, use_cache=cache is not None)
    if zm.is_encoder_decoder:
        return model(input_ids=encoder_ids(ids.shape[0]), decoder_input_ids=ids, **kwargs).logits
    positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
    return model(ids, position_ids=positions, **kwargs).logits


def oracle(zm, oracle_model, ids):
    return forward(zm, oracle_model, ids).double()


def feed(zm, cache, ids, start):
    return forward(zm, zm.model, ids, cache=cache, start=start).double()


def prefill_and_decode(zm, cache, ids):
    """Prefill ``PROMPT`` tokens then decode the rest one by one; the last logits of every step."""
    steps = [feed(zm, cache, ids[:, :PROMPT], 0)[:, -1]]
    for pos in range(PROMPT, ids.shape[1] - 1):
        steps.append(feed(zm, cache, ids[:, pos:pos + 1], pos)[:, -1])
    return torch.stack(steps, dim=1)


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_prefill_then_decode_matches_oracle_and_dynamic_cache(name):
    zm, oracle_model = zoo(name)
    ids = tokens(2, PROMPT + DECODE + 1, seed=0)
    expected = oracle(zm, oracle_model, ids)[:, PROMPT - 1:-1]
    got = prefill_and_decode(zm, new_cache(zm), ids)
    assert max_diff(got, expected) <= TOL_ORACLE
    dynamic = prefill_and_decode(zm, new_cache(zm, "dynamic"), ids)
    assert max_diff(got, dynamic) <= TOL_DYNAMIC


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3", "mamba2", "bamba", "falcon_h1", "bart"])
def test_chunked_continuation_matches_oracle(name):
    zm, oracle_model = zoo(name)
    ids = tokens(2, 20, seed=1)
    cache, got = new_cache(zm), []
    for start, stop in [(0, 6), (6, 10), (10, 11), (11, 20)]:
        got.append(feed(zm, cache, ids[:, start:stop], start))
    assert max_diff(torch.cat(got, dim=1), oracle(zm, oracle_model, ids)) <= TOL_ORACLE


def generate(model, ids, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=6, do_sample=False, **kwargs)


@pytest.mark.parametrize("name", ["llama", "mistral", "mamba", "jamba", "gpt2", "t5"])
def test_generate_matches_uncached_generate(name):
    zm, _ = zoo(name)
    ids = encoder_ids(2) if zm.is_encoder_decoder else tokens(2, PROMPT, seed=2)
    expected = generate(zm.model, ids, use_cache=False)
    assert torch.equal(generate(zm.model, ids, cache=ReferenceCache(config=zm.config)), expected)
    if zm.is_encoder_decoder:
        both = EncoderDecoderCache(ReferenceCache(), ReferenceCache())
        assert torch.equal(generate(zm.model, ids, cache=both), expected)


def test_beam_search_and_prompt_lookup_match_dynamic_cache():
    zm, _ = zoo("llama")
    ids = tokens(2, PROMPT, seed=3)
    beams = dict(num_beams=3, num_return_sequences=2)  # beam search calls reorder_cache
    assert torch.equal(generate(zm.model, ids, cache=ReferenceCache(config=zm.config), **beams),
                       generate(zm.model, ids, cache=DynamicCache(config=zm.config), **beams))
    repetitive = torch.cat([ids[:1, :6], ids[:1, :6]], dim=1)  # prompt lookup decoding calls crop()
    lookup = generate(zm.model, repetitive, cache=ReferenceCache(config=zm.config), prompt_lookup_num_tokens=3)
    assert torch.equal(lookup, generate(zm.model, repetitive, use_cache=False))


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_crop_then_different_tokens_matches_oracle_of_edited_sequence(name):
    zm, oracle_model = zoo(name)
    prompt, edit = tokens(2, PROMPT, seed=4), tokens(2, 5, seed=5)
    cache = new_cache(zm)
    feed(zm, cache, prompt, 0)
    cache.crop(-3)  # mistral: 12 tokens are past the window of 8, the evicted ones must still be right
    assert cache.get_seq_length() == PROMPT - 3
    got = [feed(zm, cache, edit[:, :2], PROMPT - 3)]  # a chunk, then single tokens
    got += [feed(zm, cache, edit[:, i:i + 1], PROMPT - 3 + i) for i in range(2, 5)]
    expected = oracle(zm, oracle_model, torch.cat([prompt[:, :-3], edit], dim=1))[:, PROMPT - 3:]
    assert max_diff(torch.cat(got, dim=1), expected) <= TOL_ORACLE


@pytest.mark.parametrize("name", ["llama", "mamba", "falcon_h1"])
def test_deepcopy_gives_an_independent_fork(name):
    zm, oracle_model = zoo(name)
    prompt, a, b = tokens(2, PROMPT, seed=6), tokens(2, 3, seed=7), tokens(2, 3, seed=8)
    cache = new_cache(zm)
    feed(zm, cache, prompt, 0)
    fork = copy.deepcopy(cache)
    for i in range(3):  # the fork runs ahead first: it must not disturb the original (decode mutates in place)
        fork_logits = feed(zm, fork, b[:, i:i + 1], PROMPT + i)
    original_logits = [feed(zm, cache, a[:, i:i + 1], PROMPT + i) for i in range(3)]
    assert max_diff(fork_logits[:, -1], oracle(zm, oracle_model, torch.cat([prompt, b], 1))[:, -1]) <= TOL_ORACLE
    expected = oracle(zm, oracle_model, torch.cat([prompt, a], 1))[:, PROMPT:]
    assert max_diff(torch.cat(original_logits, 1), expected) <= TOL_ORACLE


@pytest.mark.parametrize("name", ["llama", "mamba2", "falcon_h1"])
def test_reorder_repeat_select_match_oracle(name):
    zm, oracle_model = zoo(name)
    prompt, nxt = tokens(3, PROMPT, seed=9), tokens(6, 3, seed=10)
    cache = new_cache(zm)
    feed(zm, cache, prompt, 0)
    beam_idx = torch.tensor([2, 0, 1])
    cache.reorder_cache(beam_idx)  # rows: p2, p0, p1
    cache.batch_repeat_interleave(2)  # rows: p2, p2, p0, p0, p1, p1
    rows = beam_idx.repeat_interleave(2)
    got = feed(zm, cache, nxt[:, :1], PROMPT)
    keep = torch.tensor([5, 0, 3])
    cache.batch_select_indices(keep)
    rows, nxt = rows[keep], nxt[keep]
    got = torch.cat([got[keep], feed(zm, cache, nxt[:, 1:2], PROMPT + 1)], dim=1)
    expected = oracle(zm, oracle_model, torch.cat([prompt[rows], nxt[:, :2]], dim=1))[:, PROMPT:]
    assert max_diff(got, expected) <= TOL_ORACLE


def test_crop_count_rules_and_reset():
    zm, _ = zoo("llama")
    cache = new_cache(zm)
    feed(zm, cache, tokens(2, PROMPT, seed=11), 0)
    with pytest.raises(ValueError, match="negative count"):
        cache.crop(3)
    cache.crop(0)
    assert cache.get_seq_length() == PROMPT
    cache.crop(-100)  # more than held: empties it
    assert cache.get_seq_length() == 0 and cache.layers[0].keys is None
    feed(zm, cache, tokens(2, 4, seed=12), 0)
    cache.reset()
    assert cache.get_seq_length() == 0
    assert cache.is_croppable and not cache.is_compileable


def test_layers_follow_the_config_and_extra_kwargs_are_ignored():
    assert ReferenceCache().layers == []  # lazy: layers appear as the model updates them
    kinds = {name: ReferenceCache(config=zoo(name)[0].config, max_cache_len=64, batch_size=2, device="cpu",
                                  dtype=torch.float32).layers for name in ("gemma3", "jamba", "falcon_h1")}
    assert [(type(x), x.is_sliding) for x in kinds["gemma3"]] == [(ReferenceAttentionLayer, True),
                                                                  (ReferenceAttentionLayer, False)]
    assert [type(x) for x in kinds["jamba"]] == [ReferenceLinearAttentionLayer, ReferenceAttentionLayer]
    assert [type(x) for x in kinds["falcon_h1"]] == [ReferenceHybridLayer, ReferenceHybridLayer]


def test_linear_layer_crop_needs_recording_and_no_recurrent_state():
    zm, _ = zoo("mamba2")
    cache = new_cache(zm)
    feed(zm, cache, tokens(2, PROMPT, seed=13), 0)
    assert not cache.is_croppable
    before = cache.layers[0].conv_states[0].clone()
    with pytest.raises(RuntimeError, match="recurrent"):
        cache.crop(-1)
    assert torch.equal(cache.layers[0].conv_states[0], before)  # nothing changed

    layer = ReferenceLinearAttentionLayer()  # a conv-only layer (as in LFM2), driven by hand
    x = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)
    zeros = torch.zeros(2, 3, 3)
    assert torch.equal(layer.update_conv_state(x[..., :2], conv_kernel_size=4), torch.cat([zeros, x[..., :2]], -1))
    assert torch.equal(layer.conv_states[0], torch.cat([zeros[..., :2], x[..., :2]], -1))  # the last K = 4 inputs
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        layer.crop(-2)  # -1 would work: the next token needs only K - 1 = 3 inputs of context
    layer.activate_past_recording()
    full = layer.update_conv_state(x[..., 2:])  # the 4 held columns + the 3 new ones, all kept while recording
    assert torch.equal(full, torch.cat([zeros[..., :2], x], -1)) and torch.equal(layer.conv_states[0], full)
    layer.crop(-2)
    assert torch.equal(layer.conv_states[0], full[..., :-2]) and layer.is_croppable
    with pytest.raises(RuntimeError, match="at most 2 conv inputs"):
        layer.crop(-3)


def test_zoo_models_run_inference_only_as_generate_does():
    """The zoo's models (and the oracle's float64 copy) do not require grad: a forward records no autograd graph,
    as under generate()'s torch.no_grad, and the cache receives keys and values that do not require grad."""
    zm = build_zoo_model("llama")
    assert not any(p.requires_grad for p in zm.model.parameters())
    assert not any(p.requires_grad for p in zm.oracle_model().parameters())
    cache = DynamicCache(config=zm.config)
    out = zm.model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
    assert out.logits.grad_fn is None and not cache.layers[0].keys.requires_grad


# ---- the reference follows the installed release's protocol (ARCHITECTURE.md "The reference follows the protocol")
# What ReferenceLinearAttentionLayer may define itself: where states live and how they are rewound. Every other name of
# transformers' LinearAttentionCacheLayerMixin is bookkeeping and must resolve to transformers' own code, so that a
# release adding a counter or a recording option reaches the reference without a change in kvconform.
STORAGE = {"__init__", "lazy_initialization", "update_conv_state", "update_recurrent_state", "crop", "reset",
           "reorder_cache", "batch_repeat_interleave", "batch_select_indices", "offload", "prefetch",
           "get_max_length", "get_max_cache_shape", "is_croppable", "is_compileable", "supports_early_init",
           "__repr__", "__dict__", "__weakref__", "__module__", "__doc__", "__abstractmethods__", "_abc_impl"}
WRAPPED = {"activate_past_recording", "get_seq_length"}  # call transformers' own, then keep the reference's contract


def test_linear_reference_layer_inherits_the_releases_bookkeeping():
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    overridden = [name for name in vars(LinearAttentionCacheLayerMixin) if name not in STORAGE | WRAPPED
                  and getattr(ReferenceLinearAttentionLayer, name) is not getattr(LinearAttentionCacheLayerMixin, name)]
    assert overridden == []
    layer = ReferenceLinearAttentionLayer(number_of_states=2)
    mixin_fields = set(vars(type("Probe", (LinearAttentionCacheLayerMixin,), {
        "lazy_initialization": None, "update_conv_state": None, "update_recurrent_state": None})(2)))
    assert mixin_fields <= set(vars(layer))  # every field the release's __init__ sets (5.25: its token counter)


def test_linear_reference_length_is_an_int_snapshot_on_every_release():
    """5.25's own layers answer get_seq_length() with their live 0-d counter; the reference answers an int that the
    next forward does not change, counting in-place decode steps (increase_count) too."""
    zm, _ = zoo("mamba2")
    cache = new_cache(zm)
    ids = tokens(2, PROMPT + 3, seed=21)
    feed(zm, cache, ids[:, :PROMPT], 0)
    try:
        length = cache.get_seq_length()
    except ValueError:  # up to 5.24 an all-linear cache reports no length (transformers raises)
        pytest.skip("the installed transformers asks no linear layer for its length")
    assert type(length) is int and length == PROMPT
    for pos in range(PROMPT, PROMPT + 3):
        feed(zm, cache, ids[:, pos:pos + 1], pos)
    assert length == PROMPT and cache.get_seq_length() == PROMPT + 3


@pytest.mark.parametrize("name", ["mamba", "mamba2", "jamba"])
def test_recorded_recurrent_states_rewind_a_whole_chunk(name):
    """activate_past_recording(recurrent_states_to_keep=N) (5.25): crop a recorded chunk, then decode other
    tokens — the logits equal the oracle of the edited sequence (transformers' own layers restore a wrong state
    here on mamba and jamba: known fault linear-recorded-chunk-crop-state)."""
    from kvconform.compat import records_recurrent_states

    if not records_recurrent_states():
        pytest.skip("the installed transformers records no recurrent states (5.25 and later)")
    zm, oracle_model = zoo(name)
    cache = new_cache(zm)
    cache.activate_past_recording(recurrent_states_to_keep=4)
    ids = tokens(2, 9, seed=5)
    feed(zm, cache, ids[:, :6], 0)
    feed(zm, cache, ids[:, 6:9], 6)
    assert cache.is_croppable
    cache.crop(-3)
    assert cache.get_seq_length() == 6
    other = tokens(2, 3, seed=6)
    edited = torch.cat([ids[:, :6], other], dim=1)
    got = torch.stack([feed(zm, cache, other[:, i:i + 1], 6 + i)[:, -1] for i in range(3)], dim=1)
    assert max_diff(got, oracle(zm, oracle_model, edited)[:, 6:]) < TOL_ORACLE
    with pytest.raises(RuntimeError, match="none was recorded"):
        cache.crop(-8)  # before the recording began: refused, nothing changed
    assert cache.get_seq_length() == 9


def test_activate_past_recording_with_no_count_records_no_recurrent_state():
    """5.25 stores recurrent_states_to_keep = None for a call with no argument (and its mixers then raise TypeError:
    known fault linear-recording-none-count); the reference stores 0 and keeps refusing a recurrent crop."""
    zm, _ = zoo("mamba2")
    cache = new_cache(zm)
    cache.activate_past_recording()
    ids = tokens(2, PROMPT, seed=8)
    feed(zm, cache, ids, 0)  # a multi-token forward while recording: no TypeError
    assert all(getattr(layer, "recurrent_states_to_keep", 0) == 0 for layer in cache.layers)
    assert not cache.is_croppable
    with pytest.raises(RuntimeError, match="recurrent"):
        cache.crop(-1)


def test_a_layer_type_the_reference_does_not_model_is_named():
    from transformers import AutoConfig

    from kvconform import architectures
    from kvconform.reference import unmodelled_layer_types
    from kvconform.sweep import reference_gap

    assert unmodelled_layer_types(build_zoo_model("jamba").config) == []
    assert reference_gap(build_zoo_model("llama").config) == ""
    if "deepseek_v4" not in architectures.known_types():
        pytest.skip("the installed transformers has no DeepSeek-V4 (layer type 'heavily_compressed_attention')")
    config = AutoConfig.for_model("deepseek_v4")
    missing = unmodelled_layer_types(config)
    assert "heavily_compressed_attention" in missing
    assert "kvconform's gap" in reference_gap(config) and "heavily_compressed_attention" in reference_gap(config)


def test_a_config_whose_layer_types_read_as_none_gets_layers_as_the_model_updates():
    """transformers 5.5 reads a config's cache layers as ``layer_types[:-num_kv_shared_layers]``: none at all when
    that is 0, as in the tiny Gemma 3n of the architecture sweep. DynamicCache then adds a layer per index the model
    updates, and so must ReferenceCache (it raised IndexError in every item on those models). On releases that read
    the layers right, it builds them from the config; either way the model runs and equals DynamicCache."""
    from kvconform.architectures import build_model

    model = build_model("gemma3n_text", dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = model(ids, past_key_values=ReferenceCache(config=model.config), use_cache=True).logits
        theirs = model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True).logits
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
