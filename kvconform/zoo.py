"""The model zoo: 14 tiny text model families, 3 tiny vision-language models, a tiny MTP model and a tiny whisper
(an encoder-decoder whose encoder takes float audio features, ``AUDIO_NAMES``) built offline from configs, plus
loading a local checkpoint.

Every zoo model has hidden size 64, 2 layers, 4 attention heads (2 KV heads where the family has GQA) and a
vocabulary of 128 tokens, with deliberate asymmetries so that a cache cannot get its sizes from the wrong config
field and still pass: bart's decoder is deeper than its encoder (3 vs 2 layers) and t5's encoder deeper than its
decoder (3 vs 2), t5's key/value size (``d_kv`` 8) and gemma3's ``head_dim`` (32) differ from hidden / heads (16),
and the GQA families have fewer key/value heads than query heads. All of them are initialised with
``torch.manual_seed(seed)`` and ``initializer_range=0.1``: with the transformers default of 0.02 the top-1 margins
of a tiny model are ~1e-3, so token-level comparisons flip on float noise (measured on the zoo). Families with a
sliding window use a window of 8 tokens, and
the cases feed prompts longer than that, so the window is really exercised.

Nothing is downloaded: configs come from ``AutoConfig.for_model`` and weights from the seeded initialiser.
"""

from __future__ import annotations

import copy
from typing import Any
import functools
import os
from dataclasses import dataclass, field

ZOO_NAMES = (
    "llama", "mistral", "qwen2", "gemma2", "gemma3", "gpt2", "phi3",
    "mamba", "mamba2", "jamba", "bamba", "falcon_h1", "t5", "bart",
)
"""The zoo families, in matrix order (a stable interface: ids, reports and ``--kvconform-model`` use them)."""

VLM_NAMES = ("llava", "idefics3", "gemma3_vlm")
"""The tiny vision-language models (``vision.py``: an image prefix in every prompt). They are not in the default
run: ``--kvconform-full`` adds them, and ``--kvconform-model <name>`` runs one."""

MTP_NAMES = ("glm4_mtp",)
"""The tiny models with multi-token-prediction (MTP) layers: glm4_moe with ``num_mtp_layers = 2`` (its MTP layers
are not part of the model's weights: ``transformers.modeling_layers.MtpModel`` loads them from the model's folder
when ``generate(use_mtp=True)`` starts, so the speculative family writes a seeded one, ``checks/speculative.py``).
Like the VLMs they are not in the default run: ``--kvconform-full`` adds them, ``--kvconform-model glm4_mtp`` runs
one. Built only where the installed transformers has MTP (``MtpCache``, 5.25)."""

AUDIO_NAMES = ("whisper",)
"""The tiny encoder-decoders whose encoder input is not token ids: whisper (``WhisperForConditionalGeneration``), whose
encoder takes float log-mel features ``[B, num_mel_bins, frames]`` (``ZooModel.encoder_features``; the checks draw
them seeded, ``checks._drive.encoder_input``). ``max_source_positions`` is 10, the cases' ``encoder_len``, so its
cross-attention holds as many states as t5's and bart's. Full tier only (``--kvconform-full``, or
``--kvconform-model whisper``), like the VLMs."""

ALL_NAMES = ZOO_NAMES + VLM_NAMES + MTP_NAMES + AUDIO_NAMES
"""Every name ``--kvconform-model`` and case files accept as a zoo model."""

SLIDING_WINDOW = 8
VOCAB_SIZE = 128

_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=512,
)
_MAMBA2_MIXER = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                     mamba_expand=2, mamba_chunk_size=16)

# model_type, config kwargs. Kept as data so a reader sees every tiny config at a glance.
_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(_COMMON)),
    "mistral": ("mistral", dict(_COMMON, sliding_window=SLIDING_WINDOW)),
    "qwen2": ("qwen2", dict(_COMMON, use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1,
                            layer_types=["full_attention", "sliding_attention"])),
    "gemma2": ("gemma2", dict(_COMMON, sliding_window=SLIDING_WINDOW, head_dim=16)),
    "gemma3": ("gemma3_text", dict(_COMMON, sliding_window=SLIDING_WINDOW, head_dim=32,
                                   layer_types=["sliding_attention", "full_attention"])),
    "gpt2": ("gpt2", dict(vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                          initializer_range=0.1)),
    "phi3": ("phi3", dict(_COMMON)),
    "mamba": ("mamba", dict(vocab_size=VOCAB_SIZE, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
                            conv_kernel=4, initializer_range=0.1)),
    "mamba2": ("mamba2", dict(vocab_size=VOCAB_SIZE, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2,
                              conv_kernel=4, num_heads=8, head_dim=16, n_groups=1, chunk_size=16,
                              initializer_range=0.1)),
    "jamba": ("jamba", dict(_COMMON, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                            expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
                            mamba_expand=2, mamba_dt_rank=8)),
    "bamba": ("bamba", dict(_COMMON, attn_layer_indices=[1], **_MAMBA2_MIXER)),
    "falcon_h1": ("falcon_h1", dict(_COMMON, mamba_d_ssm=128, head_dim=16, **_MAMBA2_MIXER)),
    "t5": ("t5", dict(vocab_size=VOCAB_SIZE, d_model=64, d_kv=8, d_ff=128, num_layers=3, num_decoder_layers=2,
                      num_heads=4, initializer_factor=1.0)),
    "bart": ("bart", dict(vocab_size=VOCAB_SIZE, d_model=64, encoder_layers=2, decoder_layers=3,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                          decoder_ffn_dim=128, max_position_embeddings=512, init_std=0.1)),
    # 8 mel bins x 20 frames (two convolutions, the second of stride 2: 10 encoder states); no token suppressed
    # (the default config suppresses ids 220 and 50256, outside the tiny vocabulary)
    "whisper": ("whisper", dict(vocab_size=VOCAB_SIZE, d_model=64, encoder_layers=2, decoder_layers=3,
                                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                decoder_ffn_dim=128, num_mel_bins=8, max_source_positions=10,
                                max_target_positions=512, init_std=0.1, begin_suppress_tokens=None,
                                suppress_tokens=None)),
    # MoE (4 routed experts, 2 a token, one shared; the first layer dense) with two MTP layers (MTP_NAMES)
    "glm4_mtp": ("glm4_moe", dict(_COMMON, moe_intermediate_size=32, num_experts_per_tok=2, n_shared_experts=1,
                                  n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1,
                                  num_mtp_layers=2)),
}
# The VLMs: a text model of the zoo's size (vocabulary 128 text ids + 4 reserved ids above them: the image token
# 128 and, for gemma3, its begin/end-of-image ids) behind a one-layer vision tower of width 32 whose projector
# makes 4 image tokens of one image (llava: 8×8 pixels / patch 4 = 4 patches; idefics3: 16×16 / 4 = 16 patches,
# pixel-shuffled by 2; gemma3: 16 patches average-pooled to mm_tokens_per_image 4).
IMAGE_TOKEN, IMAGE_TOKENS, VLM_VOCAB = VOCAB_SIZE, 4, VOCAB_SIZE + 4
_VLM_TEXT = dict(_COMMON, vocab_size=VLM_VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
               num_channels=3, initializer_range=0.1)
_VLM_CONFIGS: dict[str, tuple[str, dict]] = {
    "llava": ("llava", dict(text_config=dict(_VLM_TEXT, model_type="llama"),
                            vision_config=dict(_VISION, model_type="clip_vision_model", image_size=8,
                                               projection_dim=32),
                            image_token_id=IMAGE_TOKEN, image_seq_length=IMAGE_TOKENS, vision_feature_layer=-1,
                            initializer_range=0.1)),
    "idefics3": ("idefics3", dict(text_config=dict(_VLM_TEXT, model_type="llama"),
                                  vision_config=dict(_VISION, model_type="idefics3_vision", image_size=16),
                                  image_token_id=IMAGE_TOKEN, scale_factor=2, initializer_range=0.1)),
    "gemma3_vlm": ("gemma3", dict(text_config=dict(_VLM_TEXT, model_type="gemma3_text", sliding_window=SLIDING_WINDOW,
                                                   head_dim=32, layer_types=["sliding_attention", "full_attention"]),
                                  vision_config=dict(_VISION, model_type="siglip_vision_model", image_size=16),
                                  mm_tokens_per_image=IMAGE_TOKENS, image_token_id=IMAGE_TOKEN,
                                  boi_token_index=IMAGE_TOKEN + 1, eoi_token_index=IMAGE_TOKEN + 2,
                                  initializer_range=0.1)),
}
_VLM_LAYOUT = {"llava": ("images", False), "idefics3": ("rows", False), "gemma3_vlm": ("images", True)}

# Special token ids inside the tiny vocabulary (several families default to ids > 127).
_SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


@dataclass
class ZooModel:
    """A model ready for conformance checks.

    Attributes:
        name: zoo name (``"llama"``) or, for a checkpoint, the folder's base name.
        model: the ``PreTrainedModel`` in eval mode, weights in ``dtype`` on ``device``.
        config: its config (the full config; ``config.get_text_config(decoder=True)`` for the decoder).
        dtype: the case dtype of ``model`` (``torch.float32`` by default).
        is_encoder_decoder: True for t5 / bart / whisper (the cache is an ``EncoderDecoderCache``).
        layer_types: the decoder's cache layer types, e.g. ``("sliding_attention", "full_attention")``.
        sliding_window: the smallest sliding window of any layer, or None.
        source: ``"zoo"`` or the checkpoint path.
    """

    name: str
    model: object
    config: object
    dtype: object
    is_encoder_decoder: bool
    layer_types: tuple
    sliding_window: int | None
    source: str = "zoo"
    _oracle_model: object = field(default=None, repr=False)
    image: object = None
    oracle_build: Any = field(default=None, repr=False)  # () -> the float64 model, where not a cast copy
    """A VLM's ``vision.ImagePrefix`` (its prompts start with an image), or None for a text-only model."""

    @functools.cached_property
    def vocab_size(self) -> int:
        """The ids text tokens are drawn below: the decoder's vocabulary size, or for a VLM its text ids only
        (``ImagePrefix.text_vocab``; the image and special ids above them are placed, never drawn). Read once: the
        config answers each attribute through transformers' per-layer config views, and every step's random tokens
        ask for it."""
        if self.image is not None:
            return int(self.image.text_vocab)
        return int(self.config.get_text_config(decoder=True).vocab_size)

    @property
    def decoder_depth(self) -> int | None:
        """The number of decoder layers, measured on the module tree: 1 + the largest integer ``layer_idx`` among the
        decoder's modules (the index each layer hands to ``cache.update``), or None when no module carries one. The
        config cannot say it uniformly: ``get_text_config(decoder=True).num_hidden_layers`` is the *encoder's*
        depth for t5 (``num_layers``), while its decoder has ``num_decoder_layers``."""
        decoder = self.model.get_decoder() if self.is_encoder_decoder else self.model
        found = [mod.layer_idx for mod in decoder.modules() if isinstance(getattr(mod, "layer_idx", None), int)]
        return max(found) + 1 if found else None

    @property
    def encoder_features(self) -> tuple[int, int] | None:
        """``(num_mel_bins, frames)`` of an encoder that takes float features (``main_input_name`` is
        ``input_features``: whisper) — its input is ``[B, num_mel_bins, frames]``, ``frames`` the length its forward
        requires (``2 · max_source_positions``: it raises on any other) —, or None where the encoder takes token ids
        (t5, bart) or the model has no encoder."""
        if not self.is_encoder_decoder or getattr(self.model, "main_input_name", "input_ids") != "input_features":
            return None
        encoder = self.model.get_encoder()
        stride = int(encoder.conv1.stride[0]) * int(encoder.conv2.stride[0])
        return int(self.config.num_mel_bins), int(self.config.max_source_positions) * stride

    def encoder_states(self, encoder_len: int) -> int:
        """How many encoder states (tokens) an encoder-decoder's cross-attention holds for a case whose
        ``encoder_len`` is given: ``encoder_len`` where the encoder takes that many token ids (t5, bart), the number
        its forward fixes where it takes float features (whisper: ``max_source_positions``, 10 in the zoo, 1,500 in
        a real checkpoint), whatever the case says."""
        if self.encoder_features is None:
            return encoder_len
        return int(self.config.max_source_positions)

    @property
    def has_linear_attention(self) -> bool:
        """True if any layer holds a linear-attention (conv / recurrent) state."""
        return any(t in ("linear_attention", "conv", "hybrid", "hybrid_sliding") for t in self.layer_types)

    @property
    def has_attention(self) -> bool:
        """True if any layer holds per-token keys and values."""
        return any(t not in ("linear_attention", "conv", "dummy") for t in self.layer_types)

    @property
    def has_sliding(self) -> bool:
        """True if any layer attends a sliding (or chunked) window."""
        return any(t in ("sliding_attention", "chunked_attention", "hybrid_sliding") for t in self.layer_types)

    @property
    def features(self) -> frozenset:
        """The case ``requires`` vocabulary this model satisfies (``cases.REQUIREMENTS``): ``decoder_only`` or
        ``encoder_decoder``, and ``attention`` / ``sliding`` / ``linear_attention`` where its layers have them."""
        feats = {"encoder_decoder" if self.is_encoder_decoder else "decoder_only"}
        feats |= {name for name, has in (("attention", self.has_attention), ("sliding", self.has_sliding),
                                         ("linear_attention", self.has_linear_attention)) if has}
        return frozenset(feats)

    def oracle_model(self):
        """The same weights in float64 on CPU (built once, lazily): the oracle's model — a float64 copy of
        ``model``, or what ``oracle_build`` returns where it is set (a model adapter's ``build(float64, "cpu")``,
        as docs/from-scratch.md says)."""
        import torch

        if self._oracle_model is None and self.oracle_build is not None:  # a model adapter: its build(float64)
            self._oracle_model = self.oracle_build()
        if self._oracle_model is None:
            from kvconform.compat import prepare_float64

            oracle = copy.deepcopy(self.model).to(device="cpu", dtype=torch.float64).eval()
            self._oracle_model = prepare_float64(oracle)
        return self._oracle_model


def _layer_types(config) -> tuple[tuple, int | None]:
    from kvconform.compat import layer_types_and_kwargs

    types, kwargs = layer_types_and_kwargs(config)
    windows = [kw["sliding_window"] for kw in kwargs if kw.get("sliding_window")]
    return tuple(types), (min(windows) if windows else None)


def zoo_config_type(name: str) -> str:
    """The transformers model type a zoo family is built from (``"mamba"``, ``"llama"``)."""
    return _CONFIGS[name][0]


def zoo_config(name: str):
    """The tiny ``PretrainedConfig`` of zoo family ``name``.

    Raises:
        KeyError: ``name`` is not in ``ZOO_NAMES``.
    """
    from transformers import AutoConfig

    if name in _VLM_CONFIGS:
        model_type, kwargs = _VLM_CONFIGS[name]
        return AutoConfig.for_model(model_type, **kwargs)
    if name not in _CONFIGS:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(ALL_NAMES)}")
    model_type, kwargs = _CONFIGS[name]
    config = AutoConfig.for_model(model_type, **kwargs, **_SPECIAL_TOKENS)
    return config


def image_prefix(name: str, config):
    """The ``vision.ImagePrefix`` of VLM ``name`` built from ``config`` (its image token, the image size of its
    vision tower, the pixel layout its forward takes), or None for a text-only family."""
    from kvconform import vision

    if name not in _VLM_LAYOUT:
        return None
    layout, token_types = _VLM_LAYOUT[name]
    size = int(config.vision_config.image_size)
    return vision.ImagePrefix(image_token_id=int(config.image_token_id), tokens=IMAGE_TOKENS,
                              pixel_shape=(int(config.vision_config.num_channels), size, size), layout=layout,
                              token_type_ids=token_types, text_vocab=VOCAB_SIZE, vocab=VLM_VOCAB)


def _finish(name, model, dtype, device, source) -> ZooModel:
    import torch

    from kvconform.compat import prepare_float64

    model = model.to(device=device, dtype=dtype).eval()
    if dtype == torch.float64:  # a float64 case's model is prepared as the oracle's is (MoE experts: eager)
        model = prepare_float64(model)
    # Inference only, as generate() runs (under torch.no_grad): no forward records an autograd graph, and a cache
    # sees keys and values that do not require grad. Recording it made a tiny model's decode step 15-20% slower
    # (llama, 21 forwards: 37.3 → 31.3 ms; mamba2: 82.7 → 68.3 ms).
    model.requires_grad_(False)
    # Greedy, no early stop at eos: the generate checks compare fixed-length continuations.
    gc = model.generation_config
    gc.eos_token_id = None
    gc.pad_token_id = 0
    gc.do_sample = False
    gc.temperature = gc.top_p = gc.top_k = None
    types, window = _layer_types(model.config)
    return ZooModel(
        name=name, model=model, config=model.config, dtype=dtype,
        is_encoder_decoder=bool(getattr(model.config, "is_encoder_decoder", False)),
        layer_types=types, sliding_window=window, source=source,
    )


def build_zoo_model(name: str, dtype=None, device: str = "cpu", seed: int = 0) -> ZooModel:
    """Build zoo family ``name`` with seeded random weights.

    Args:
        name: one of ``ZOO_NAMES``.
        dtype: torch dtype of the weights (default ``torch.float32``).
        device: torch device string.
        seed: ``torch.manual_seed`` used before initialisation (same seed → same weights).

    Raises:
        KeyError: unknown ``name``.
    """
    import torch
    from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM,
                              AutoModelForSpeechSeq2Seq)

    from kvconform import vision

    dtype = dtype or torch.float32
    config = zoo_config(name)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    if name in VLM_NAMES:
        auto = AutoModelForImageTextToText
    if name in AUDIO_NAMES:
        auto = AutoModelForSpeechSeq2Seq
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config)
    if name in VLM_NAMES:
        vision.seed_zero_projections(model, seed)  # gemma3's projection starts at zeros: no image would get through
    zm = _finish(name, model, dtype, device, "zoo")
    zm.image = image_prefix(name, config)
    if zm.image is not None:
        vision.attach(zm.model, zm.image)
    return zm


def load_checkpoint(path: str, dtype=None, device: str = "cpu", trust_remote_code: bool = False) -> ZooModel:
    """Load a local Hugging Face checkpoint folder (``config.json`` + weights), never downloading.
    ``trust_remote_code``: run the folder's own code (config.json ``auto_map``); passed to transformers explicitly
    either way, so it never prompts on stdin.

    Raises:
        FileNotFoundError: ``path`` is not a folder with a ``config.json``.
    """
    import torch
    from transformers import AutoModelForImageTextToText

    from kvconform import architectures, vision

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} is not a checkpoint folder: no config.json in it")
    dtype = dtype or torch.float32
    trust = dict(trust_remote_code=bool(trust_remote_code))
    config = checkpoint_config(path, trust_remote_code)
    auto = architectures.auto_model_class(config, prefer_vision=True)
    model = auto.from_pretrained(path, local_files_only=True, dtype=dtype, **trust)
    zm = _finish(checkpoint_name(path), model, dtype, device, os.path.abspath(path))
    if auto is AutoModelForImageTextToText:  # a vision-language checkpoint: every prompt starts with an image
        zm.image = architectures.image_prefix(zm.model, text_vocab=_lowest_special_id(zm.config))
        vision.attach(zm.model, zm.image)
    return zm


def _lowest_special_id(config) -> int | None:
    """The lowest image / video / boundary token id a vision-language config declares (text prompts are drawn
    below it, so no drawn token is read as an image), or None when it declares none."""
    ids = [v for k, v in vars(config).items()
           if isinstance(v, int) and not isinstance(v, bool) and k.endswith(("_token_id", "_token_index"))
           and not k.startswith(("pad", "bos", "eos", "decoder_start"))]
    return min(ids) if ids else None


def checkpoint_name(path: str) -> str:
    """The name of a checkpoint folder in ids and reports: its base name with every character outside
    ``[A-Za-z0-9_.]`` replaced by ``_`` (``-`` separates the parts of an item id), prefixed ``ckpt_`` when it would
    read as a zoo family (a folder ``./llama`` is ``ckpt_llama``, never the zoo's ``llama``)."""
    base = os.path.basename(os.path.normpath(os.path.abspath(os.path.expanduser(path))))
    name = "".join(c if c.isalnum() or c in "_." else "_" for c in base) or "checkpoint"
    return f"ckpt_{name}" if name in ALL_NAMES else name


def is_checkpoint_spec(spec: str) -> bool:
    """True when ``spec`` names a local folder rather than a zoo family: anything written as a path (``./llama``,
    ``/abs/llama``, ``~/m``, ``ckpt/llama``) is a folder, even if its last part is a zoo name; a bare word is a zoo
    family when it is one (``llama``), else a folder."""
    if spec.startswith("transformers:"):
        return False  # an architecture of transformers (architectures.py)
    if os.sep in spec or "/" in spec or spec.startswith(("~", ".")):
        return True
    return spec not in ALL_NAMES


WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
"""The weight files ``from_pretrained`` loads from a local folder (safetensors first, then PyTorch pickles)."""


def checkpoint_problem(path: str) -> str | None:
    """Why ``path`` is not a loadable checkpoint folder (no folder, no ``config.json``, no weight file), or None."""
    import glob

    if not os.path.isdir(path):
        return "no such folder" if not os.path.exists(path) else "not a folder"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return "folder has no config.json (not a checkpoint)"
    if not any(glob.glob(os.path.join(path, pattern)) for pattern in WEIGHT_PATTERNS):
        return f"folder has a config.json but no weights ({' or '.join(WEIGHT_PATTERNS)})"
    return None


def checkpoint_config(path: str, trust_remote_code: bool = False):
    """A checkpoint folder's ``config.json`` as a transformers config, without weights (``trust_remote_code``: with
    the folder's own configuration class)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.path.expanduser(path), local_files_only=True,
                                      trust_remote_code=bool(trust_remote_code))


def build_architecture(model_type: str, dtype=None, device: str = "cpu") -> ZooModel:
    """One architecture of transformers (``transformers:<model_type>``), built tiny from its default config
    (``architectures.build_model``) → ``ZooModel``."""
    from kvconform import architectures, vision

    model = architectures.build_model(model_type, dtype=dtype)
    zm = _finish(architectures.model_name(model_type), model, model.dtype, device, f"transformers:{model_type}")
    zm.image = vision.of(model)
    return zm


def load_model(spec: str, dtype=None, device: str = "cpu", trust_remote_code: bool = False) -> ZooModel:
    """A zoo name, an architecture (``transformers:TYPE``) or a checkpoint folder → ``ZooModel``, for code below the
    model sources (the sweep); code above them asks the model's source (``ModelSource.build``)
    (``trust_remote_code``: see ``load_checkpoint``).

    Raises:
        KeyError / FileNotFoundError: neither a zoo name nor a checkpoint folder.
    """
    if spec.startswith("transformers:"):  # one architecture of transformers, built tiny (architectures.py)
        return build_architecture(spec.removeprefix("transformers:"), dtype=dtype, device=device)
    if not is_checkpoint_spec(spec):
        return build_zoo_model(spec, dtype=dtype, device=device)
    return load_checkpoint(os.path.expanduser(spec), dtype=dtype, device=device, trust_remote_code=trust_remote_code)
