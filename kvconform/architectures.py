"""Every causal-LM architecture of the installed transformers, built tiny from its own config class.

A model spec ``transformers:PATTERN`` (fnmatch over the model types of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``:
``transformers:*``, ``transformers:qwen*``, ``transformers:llama``) names those architectures. Each is built from
its own config class with its defaults shrunk generically (``overrides``): hidden size 64, 2 layers (as many as it
takes to keep one layer of each distinct layer type), 4 attention heads and 2 key/value heads where it has them,
head sizes 16, feed-forward sizes 128, vocabulary 256, windows and chunks of 8, experts 4 (2 per token), state and
low-rank sizes small, per-layer lists cut to the layers kept, sub-configs shrunk the same way; weights seeded and
``initializer_range`` 0.1 like the zoo. Nothing is downloaded.

Whether a built architecture is a causal language model, and what it is, is for the session to decide
(``session.survey_architectures``): this module only builds.
"""

from __future__ import annotations

import fnmatch

from kvconform.outcomes import KVConformError, UsageError

PREFIX = "transformers:"
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, WINDOW = 64, 2, 4, 2, 16, 128, 256, 8
MAX_PARAMETERS = 20_000_000
"""An architecture still larger than this after shrinking is not built (its defaults resist the generic shrink)."""

# attribute name → value, applied wherever a config (or a sub-config) has the attribute set to a number
_SIZES = {
    # widths
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "embed_dim": HIDDEN, "dim": HIDDEN,
    "word_embed_proj_dim": HIDDEN, "embedding_size": HIDDEN, "hidden_size_per_layer_input": 16,
    "text_hidden_size": HIDDEN, "n_embed": HIDDEN, "emb_dim": HIDDEN,
    # depth
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "num_layers": LAYERS, "n_layers": LAYERS,
    "decoder_layers": LAYERS, "encoder_layers": LAYERS, "num_decoder_layers": LAYERS, "num_encoder_layers": LAYERS,
    # heads
    "num_attention_heads": HEADS, "n_head": HEADS, "num_heads": HEADS, "n_heads": HEADS,
    "decoder_attention_heads": HEADS, "encoder_attention_heads": HEADS, "attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "n_kv_heads": KV_HEADS, "num_kv_heads": KV_HEADS,
    "multi_query_group_num": KV_HEADS, "num_global_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM, "d_kv": HEAD_DIM, "kv_channels": HEAD_DIM, "attention_head_size": HEAD_DIM,
    "global_head_dim": HEAD_DIM, "v_head_dim": HEAD_DIM, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "qk_head_dim": HEAD_DIM, "kv_lora_rank": 16, "q_lora_rank": 32, "index_head_dim": HEAD_DIM,
    "index_n_heads": HEADS, "index_topk": 8,
    # feed-forward
    "intermediate_size": FFN, "ffn_dim": FFN, "n_inner": FFN, "d_ff": FFN, "decoder_ffn_dim": FFN,
    "encoder_ffn_dim": FFN, "ffn_hidden_size": FFN, "inner_hidden_size": FFN, "mlp_dim": FFN,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "intermediate_size_mlp": FFN, "moe_ffn_hidden_size": 32, "dense_intermediate_size": FFN,
    "feed_forward_proj_size": FFN, "expert_ffn_hidden_size": 32, "shared_intermediate_size": 32,
    # experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "top_k": 2, "n_shared_experts": 1,
    "num_shared_experts": 1, "n_group": 1, "topk_group": 1, "moe_num_shared_experts": 1,
    "num_experts_per_token": 2, "zero_expert_num": 2, "encoder_hash_byte_group_vocab": VOCAB,
    # vocabulary and positions
    "vocab_size": VOCAB, "max_position_embeddings": 512, "n_positions": 512, "n_ctx": 512,
    "max_sequence_length": 512, "seq_length": 512,
    # windows
    "sliding_window": WINDOW, "attention_chunk_size": WINDOW, "window_size": WINDOW, "local_window_size": WINDOW,
    "sliding_window_size": WINDOW, "attention_window_size": WINDOW,
    # recurrent / state-space sizes
    "state_size": 8, "mamba_d_state": 8, "ssm_state_size": 8, "d_state": 8, "time_step_rank": 8,
    "mamba_dt_rank": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "lru_width": HIDDEN,
}
_INTS_KEPT = ("conv_kernel", "mamba_d_conv", "conv_L_cache", "linear_conv_kernel_dim")
_PER_LAYER_SUFFIXES = ("layer_types", "_pattern", "layers_block_type", "block_types")


def model_types(pattern: str) -> list[str]:
    """The causal-LM and image-text-to-text model types of the installed transformers matching fnmatch ``pattern``,
    sorted.

    Raises:
        UsageError: none matches (names the pattern and a few types).
    """
    known = known_types()
    found = [t for t in known if fnmatch.fnmatchcase(t, pattern)]
    if not found:
        raise UsageError(f"--kvconform-model {PREFIX}{pattern}: no causal-LM architecture of transformers matches "
                         f"{pattern!r}, nor an image-text-to-text one ({len(known)} known, e.g. "
                         f"{', '.join(known[:6])}, ...)")
    return found


def known_types() -> list[str]:
    """Every model type ``transformers:*`` tries, sorted: the causal-LM architectures of the installed transformers
    (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) and its image-text-to-text ones
    (``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))


def is_vision_type(model_type: str) -> bool:
    """True for an image-text-to-text architecture that is not also a causal LM (those keep their causal-LM class
    and text prompts): it is built with ``AutoModelForImageTextToText``'s class and gets an image prefix."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and model_type not in \
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def is_architecture_spec(spec: str) -> bool:
    """True for a ``transformers:PATTERN`` spec."""
    return isinstance(spec, str) and spec.startswith(PREFIX)


def model_name(model_type: str) -> str:
    """The name of an architecture in ids and reports: ``tf_<model type>`` with characters outside
    ``[A-Za-z0-9_.]`` made ``_`` (``gpt-sw3`` → ``tf_gpt_sw3``); never a zoo name."""
    return "tf_" + "".join(c if c.isalnum() or c in "_." else "_" for c in model_type)


def _keep_layers(types: list, layers: int) -> list[int]:
    """Which of the original layers to keep: one of each distinct type in first-appearance order, then the first
    ones, ``max(layers, distinct types)`` in all, in their original order."""
    chosen: list[int] = []
    seen = set()
    for i, t in enumerate(types):
        key = repr(t)
        if key not in seen:
            seen.add(key)
            chosen.append(i)
    for i in range(len(types)):
        if len(chosen) >= max(layers, len(seen)):
            break
        if i not in chosen:
            chosen.append(i)
    return sorted(chosen)


def _layer_count_names(config) -> list[str]:
    return [n for n in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
            if isinstance(getattr(config, n, None), int) and not isinstance(getattr(config, n), bool)]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_LINEAR_TYPES = {"mamba": "attention", "linear_attention": "full_attention"}
"""Layer types holding a recurrent (linear-attention) state, each with the name of an attention layer in the same
naming (transformers' legacy ``mamba`` / ``attention`` and its current ``linear_attention`` / ``full_attention``)."""


_FIXED = {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
          "rotary_dim": 8, "num_kv_shared_layers": 0, "num_dense_layers": 1, "first_k_dense_replace": 1,
          "num_nextn_predict_layers": 0, "initializer_range": 0.1, "init_std": 0.1, "num_codebooks": 1}
"""Values set wherever the attribute exists: layer periods that fit in 2 layers (one attention / expert layer),
a rotary width within the shrunk head size, no layers beyond the ones kept."""


def overrides(config, depth: int = 0) -> dict:
    """The keyword arguments that rebuild ``config``'s class tiny (module docstring): sizes capped, per-layer lists
    (``layer_types`` and any list as long as the layer count) and per-layer dicts keyed by layer index cut to the
    layers kept (one of each distinct layer type), sub-configs as dicts of their own overrides."""
    from transformers import PretrainedConfig

    counts = _layer_count_names(config)
    original = getattr(config, counts[0]) if counts else None
    keep = None
    values = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    if original:
        for name, value in values.items():
            if isinstance(value, (list, tuple)) and len(value) == original and value and \
                    (name.endswith(_PER_LAYER_SUFFIXES) or name == "layer_types"):
                keep = _keep_layers(list(value), LAYERS)
                break
        keep = keep if keep is not None else list(range(min(original, LAYERS)))
        types = values.get("layer_types")
        if isinstance(types, (list, tuple)) and len(types) == original and \
                all(types[i] in _LINEAR_TYPES for i in keep):  # a hybrid keeps one of its attention layers
            keep = sorted([*keep, *[i for i, t in enumerate(types) if t not in _LINEAR_TYPES][:1]])
    out: dict = {}
    for name, value in values.items():
        if isinstance(value, PretrainedConfig) and depth < 3:
            sub = value.to_dict()
            sub.pop("transformers_version", None)
            if sub.pop("per_layer_config", None):  # keyed by the original layer indices: derived again, tiny
                sub["global_head_dim"] = 2 * HEAD_DIM
            out[name] = {**sub, **overrides(value, depth + 1)}
        elif name in _FIXED and value is not None:
            out[name] = _FIXED[name]
        elif name in _SIZES and _is_int(value) and value > 0:
            out[name] = min(value, _SIZES[name])
        elif original and isinstance(value, (list, tuple)) and len(value) == original and name not in counts:
            out[name] = type(value)(value[i] for i in keep)
        elif original and isinstance(value, dict) and value and all(_is_int(k) or str(k).isdigit() for k in value):
            remap = {str(i): j for j, i in enumerate(keep)}
            out[name] = {remap[str(k)]: v for k, v in value.items() if str(k) in remap}
    if _is_int(values.get("num_key_value_heads")) and values.get("num_key_value_heads") == \
            values.get("num_attention_heads"):
        out["num_key_value_heads"] = out.get("num_attention_heads", HEADS)  # multi-head stays multi-head
    for name, value in values.items():  # a repeating pattern shorter than the depth: one period of it
        if original and name.endswith(("block_types", "_pattern")) and isinstance(value, (list, tuple)) and \
                1 < len(value) < original:
            keep = list(range(len(value)))
    if original:
        for name in counts:
            if not isinstance(getattr(type(config), name, None), property):  # derived counts (prophetnet) stay
                out[name] = len(keep)
    if original and _is_int(values.get("n_input_layers")) and _is_int(values.get("n_output_layers")):
        # input / recurrent / output sections (dory: 8 + rest + 8 of 36) must add up to the layers kept, else the
        # recurrent section has a negative size: one input layer, the rest recurrent, no output layer
        out["n_input_layers"], out["n_output_layers"] = 1, 0
        out["n_recurrent_layers"] = len(keep) - 1
    heads = out.get("num_attention_heads", values.get("num_attention_heads"))
    if "head_dim" in values and values["head_dim"] is None and _is_int(heads):
        out["head_dim"] = HIDDEN // heads  # None means hidden / heads, which some modeling code does not derive
    if values.get("num_experts_per_tok", 0) is None and _is_int(values.get("n_routed_experts")):
        out["num_experts_per_tok"] = 2  # None: the modeling code routes to top-None experts
    if "num_key_value_heads" in values and values["num_key_value_heads"] is None:
        out["num_key_value_heads"] = KV_HEADS
    if _is_int(values.get("qk_rope_head_dim")) and _is_int(values.get("head_dim")):
        out["head_dim"] = out["qk_rope_head_dim"]  # multi-head latent attention: rope width = head_dim
        out["qk_head_dim"] = out["qk_rope_head_dim"] + out.get("qk_nope_head_dim", 0)
    if "attn_layer_indices" in values:
        out["attn_layer_indices"] = [1]  # one linear-attention layer, then one attention layer
    types = out.get("layer_types")
    if isinstance(types, list) and types and len(set(types)) == 1 and types[0] in _LINEAR_TYPES:
        # a hybrid whose default stack is all linear attention (granitemoehybrid): one attention layer too
        out["layer_types"] = [types[0], _LINEAR_TYPES[types[0]]][: len(types)]
    hidden = out.get("hidden_size", values.get("hidden_size"))
    for heads, dim, expand in (("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("num_heads", "head_dim", "expand")):
        if _is_int(values.get(expand)) and _is_int(out.get(dim, values.get(dim))) and _is_int(hidden) and \
                heads in values and ("state_size" in values or "mamba_d_state" in values):
            out[heads] = max(1, values[expand] * hidden // out.get(dim, values[dim]))
    for name, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2), ("decoder_start_token_id", 1)):
        current = values.get(name)
        if (_is_int(current) and current >= VOCAB) or isinstance(current, list):
            out[name] = value
    if values.get("is_decoder") is False and not values.get("is_encoder_decoder"):
        # encoder families registered as causal LMs (BertLMHeadModel ...) are causal only with is_decoder=True,
        # which their causal-LM class asks for; the session's causality check refuses those that stay bidirectional
        out["is_decoder"] = True
    return out


def tiny_config(model_type: str, extra: dict | None = None):
    """The config of ``model_type`` built by its own config class from ``overrides`` of its defaults (so that the
    class derives what depends on them: head sizes, layer types, ...), then ``extra`` set on it.

    Raises:
        Exception: whatever the config class raises for the shrunk values (the caller reports it).
    """
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    kwargs = overrides(cls())
    if is_vision_type(model_type):
        kwargs = _vision_overrides(cls(), kwargs)
    config = cls(**kwargs)
    cls_lm = causal_lm_class(model_type)
    wanted = getattr(cls_lm, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):  # a composite config whose LM takes a sub-config
        for sub in (config.get_text_config(decoder=True), getattr(config, "decoder", None)):
            if isinstance(sub, wanted):
                config = sub
                break
    for name, value in (extra or {}).items():
        setattr(config, name, value)
    return config


def auto_model_class(config, prefer_vision: bool = False):
    """The transformers auto class that builds a language model of ``config``: ``AutoModelForSeq2SeqLM`` for an
    encoder-decoder (``AutoModelForSpeechSeq2Seq`` for one only that mapping maps: whisper),
    ``AutoModelForImageTextToText`` for a vision-language config that the image-text-to-text mapping maps and the
    causal-LM mapping does not (LLaVA, Idefics3), else ``AutoModelForCausalLM`` (which may not map it
    either: the caller refuses that). ``prefer_vision``: the image-text-to-text class wherever that mapping maps the
    config, also when the causal-LM mapping does (Gemma3's multimodal config maps to the same class in both): a
    checkpoint folder with a vision tower is checked with images in its prompts."""
    from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM,
                              AutoModelForSpeechSeq2Seq)

    if getattr(config, "is_encoder_decoder", False):
        if type(config) not in AutoModelForSeq2SeqLM._model_mapping and \
                type(config) in AutoModelForSpeechSeq2Seq._model_mapping:
            return AutoModelForSpeechSeq2Seq  # a speech encoder-decoder (whisper): float features in
        return AutoModelForSeq2SeqLM
    if type(config) in AutoModelForImageTextToText._model_mapping and \
            (prefer_vision or type(config) not in AutoModelForCausalLM._model_mapping):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def causal_lm_class(model_type: str):
    """The causal-LM class transformers maps ``model_type`` to (an image-text-to-text type that is no causal LM:
    its image-text-to-text class, ``is_vision_type``)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    if is_vision_type(model_type):
        return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[CONFIG_MAPPING[model_type]]
    return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]


TEXT_VOCAB = VOCAB - 8
"""A built VLM's text tokens are drawn below this id; its image token and other special ids above ``VOCAB``'s
range are moved into ``TEXT_VOCAB .. VOCAB - 1``."""
IMAGE_PATCHES = 2
"""Patches per side of a built VLM's image (``image_size = IMAGE_PATCHES · patch_size``; more where the projector
merges patches: its ``scale_factor`` / ``spatial_merge_size``), so that one image makes few tokens and the cases'
prompts of 8-12 tokens hold it."""


def _vision_overrides(config, kwargs: dict) -> dict:
    """``kwargs`` of a VLM's config made to fit its tiny text model: every image-size of a sub-config with a
    ``patch_size`` cut to ``IMAGE_PATCHES`` patches per side, ``mm_tokens_per_image`` to 4, the image token and
    every other special token id the shrunk vocabulary cannot hold moved into ``TEXT_VOCAB .. VOCAB - 1``."""
    out = dict(kwargs)
    side = max([IMAGE_PATCHES, *(getattr(config, n) for n in ("scale_factor", "spatial_merge_size")
                                 if _is_int(getattr(config, n, None)))])
    for name, sub in list(out.items()):
        if isinstance(sub, dict) and _is_int(sub.get("patch_size")) and _is_int(sub.get("image_size")):
            merge = sub.get("spatial_merge_size")
            per_side = max(side, merge if _is_int(merge) else 1)
            out[name] = {**sub, "image_size": min(sub["image_size"], per_side * sub["patch_size"])}
    if _is_int(getattr(config, "mm_tokens_per_image", None)):
        out["mm_tokens_per_image"] = 4
    for name, sub in list(out.items()):  # the projector's output width is the text model's
        if isinstance(sub, dict) and _is_int(sub.get("projection_dim")):
            out[name] = {**sub, "projection_dim": HIDDEN}
    if _is_int(getattr(config, "projection_dim", None)):
        out["projection_dim"] = HIDDEN
    free = iter(range(VOCAB - 1, TEXT_VOCAB - 1, -1))
    for name in ("image_token_id", "image_token_index"):
        if _is_int(getattr(config, name, None)):
            out[name] = next(free)
            break
    for name, value in sorted(vars(config).items()):
        if name not in out and name.endswith(("_token_id", "_token_index")) and _is_int(value) and value >= TEXT_VOCAB:
            nxt = next(free, None)
            if nxt is not None:
                out[name] = nxt
    return out


class ImageProbeFailed(RuntimeError, KVConformError):
    """A VLM whose image input kvconform could not feed (no image token id, no image size, no forward that took
    one synthetic image)."""


def image_prefix(model, text_vocab: int | None = None):
    """The ``vision.ImagePrefix`` of a built VLM, measured: its image token id and image size from the config, and
    how many image tokens one image makes and which ``pixel_values`` layout the forward takes, found by feeding it
    one synthetic image (a mismatch error names the features one image makes: tried again with that count).
    ``text_vocab``: prompts draw their text tokens below this id (default ``TEXT_VOCAB``, where a tiny built model's
    special ids start; a checkpoint passes the lowest of its special ids).

    Raises:
        ImageProbeFailed: no forward with one image went through (names the last error).
    """
    import inspect
    import re

    import torch

    from kvconform import vision

    cfg = model.config
    token = next((getattr(cfg, n) for n in ("image_token_id", "image_token_index") if _is_int(getattr(cfg, n, None))),
                 None)
    vc = getattr(cfg, "vision_config", None)
    size = getattr(vc, "image_size", None)
    if token is None or not _is_int(size):
        raise ImageProbeFailed(f"no {'image token id' if token is None else 'integer vision_config.image_size'} in "
                               f"its config")
    param = next(model.parameters())
    takes = inspect.signature(model.forward).parameters
    text = cfg.get_text_config(decoder=True)
    last: Exception | None = None
    variants = [("images", False), ("images", True), ("rows", False)]
    for layout, sizes in [(lay, s) for lay, s in variants if not s or "image_sizes" in takes]:
        tried: list[int] = []
        counts = [1]
        while counts and len(tried) < 4:
            k = counts.pop(0)
            tried.append(k)
            spec = vision.ImagePrefix(int(token), k, (int(getattr(vc, "num_channels", 3) or 3), size, size), layout,
                                      "token_type_ids" in takes, text_vocab or TEXT_VOCAB, int(text.vocab_size),
                                      image_sizes=sizes)
            ids = vision.with_image(spec, torch.full((1, spec.span + 1), 3, dtype=torch.long))
            try:
                with torch.no_grad():
                    model(input_ids=ids.to(param.device), use_cache=False,
                          **vision.image_inputs(spec, ids, param.dtype, param.device))
                return spec
            except Exception as exc:  # noqa: BLE001 - the probe's answer
                last = exc
                found = re.search(r"features:?\s*(\d+)", str(exc))
                if found:  # the features one image makes: a count of tokens, or of elements (tokens × width)
                    n = int(found.group(1))
                    counts += [c for c in (n, n // int(text.hidden_size or 1)) if c > 0 and c not in tried]
    why = str(last).strip().splitlines()[0][:160] if last is not None and str(last).strip() else ""
    raise ImageProbeFailed(f"no forward took one synthetic image: {type(last).__name__}: {why}")


def build_model(model_type: str, dtype=None, seed: int = 0, extra: dict | None = None):
    """The tiny model of ``model_type`` (``tiny_config``) with seeded weights, in eval mode, on CPU.

    Raises:
        TooLarge: it has more than ``MAX_PARAMETERS`` parameters after shrinking (counted on the meta device
            before any weight is allocated).
        Exception: whatever building it raises.
    """
    import torch

    config = tiny_config(model_type, extra)
    cls = causal_lm_class(model_type)
    with torch.device("meta"):
        count = sum(p.numel() for p in cls(config).parameters())
    if count > MAX_PARAMETERS:
        raise TooLarge(f"{count / 1e6:.0f}M parameters after the generic shrink (limit {MAX_PARAMETERS / 1e6:.0f}M)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model = model.to(dtype=dtype or torch.float32).eval()
    if is_vision_type(model_type):
        from kvconform import vision

        vision.seed_zero_projections(model, seed)
        vision.attach(model, image_prefix(model))
    return model


class TooLarge(RuntimeError, KVConformError):
    """An architecture whose defaults resist the generic shrink (``MAX_PARAMETERS``)."""


POSITION_KINDS = ("rotary_positions", "learned_positions", "alibi_positions", "relative_positions", "no_positions")
"""How a model encodes positions, as a cache may scope itself to it (``kvconform_supports``): rotary embeddings
(RoPE), a learned absolute table, ALiBi biases, T5's bucketed relative bias, or none (state-space models, Jamba)."""

_RELATIVE_TYPES = frozenset({"t5", "mt5", "umt5", "longt5", "switch_transformers", "pop2piano", "udop"})
_NO_POSITION_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "jamba", "rwkv"})
_ALIBI_TYPES = frozenset({"bloom", "mpt"})


def position_kind(config) -> str | None:
    """Which of ``POSITION_KINDS`` a model of ``config`` uses (its decoder's text config), or None when it cannot
    be told (a config of no known kind). A config may say it itself with a ``kvconform_positions`` attribute (a model
    adapter's ``positions``)."""
    if config is None:
        return None
    own = getattr(config, "kvconform_positions", None)
    if own:
        return own if own in POSITION_KINDS else f"{own}_positions"
    try:
        text = config.get_text_config(decoder=True)
    except Exception:  # noqa: BLE001 - a config without sub-configs is its own text config
        text = config
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    if model_type in _NO_POSITION_TYPES:
        return "no_positions"
    if model_type in _RELATIVE_TYPES or getattr(config, "is_encoder_decoder", False) and model_type.startswith("t5"):
        return "relative_positions"
    if getattr(text, "alibi", False) or model_type in _ALIBI_TYPES:
        return "alibi_positions"
    if (getattr(text, "rope_parameters", None) is not None or getattr(text, "rope_theta", None) is not None
            or getattr(text, "rotary_dim", None)):
        return "rotary_positions"
    if getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None):
        return "learned_positions"
    return None
