"""The built-in subjects with their budgets: ReferenceCache, DynamicCache, StaticCache, the QuantizedCache
subjects (each with its fake-quant twin), the offloaded caches and the speculative drafters' caches (MtpCache,
DFlashCache) (``builtin_subjects``)."""

from __future__ import annotations

from kvconform.subjects.spec import CAPABILITIES, Budget, CacheSpec

# ---------------------------------------------------------------------------------------------------- built-ins
def _reference(**kwargs):
    from kvconform.reference import ReferenceCache

    return ReferenceCache(**kwargs)


def _dynamic(config):
    from transformers import DynamicCache

    return DynamicCache(config=config)


def _static(config, max_cache_len):
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=max_cache_len)


def static_crop_note() -> dict:
    """``CacheSpec.notes`` for static subjects: ``{"crop": reason}`` where the installed static layers cannot crop
    (``compat.static_layers_crop``), else ``{}``."""
    from kvconform import compat

    if compat.static_layers_crop():
        return {}
    return {"crop": f"StaticLayer has no crop() on transformers {compat.transformers_version()} (added in 5.24)"}


# ---------------------------------------------------------------------------------------------------- speculative
def _mtp(config):
    from transformers.cache_utils import MtpCache

    return MtpCache(config=config)


def _dflash(config):
    from transformers.cache_utils import DFlashCache

    return DFlashCache(config=config)


MTP_NOTE = ("MtpCache is the cache of a model's multi-token-prediction layers (its query offsets and mask sizes are "
            "shifted by layer_idx + 1, the depth of each MTP layer), not a model's own cache: it is checked on the "
            "MTP path only (check_speculative_mtp)")


def has_mtp_layers(model) -> str | None:
    """``CacheSpec.applies_to`` of the MtpCache subject: None for a model with MTP layers (``num_mtp_layers`` ≥ 1:
    a zoo model of ``zoo.MTP_NAMES``, or a checkpoint or architecture whose config sets it), else the reason."""
    from kvconform import zoo

    if model.spec in zoo.MTP_NAMES:
        return None
    if model.spec not in zoo.ALL_NAMES:
        try:
            config = model.model_config()  # its source reads it (plan.ModelInfo)
            if int(getattr(config.get_text_config(decoder=True), "num_mtp_layers", 0) or 0) > 0:
                return None
        except Exception:  # noqa: BLE001 - no config to read: no MTP layers known
            pass
    return f"MtpCache serves a model's MTP layers; {model.name} has none (num_mtp_layers unset)"


def speculative_subjects() -> list:
    """transformers' caches of speculative drafters (5.25): ``MtpCache`` (``MTPCandidateGenerator``: the MTP layers'
    cache) and ``DFlashCache`` (``DFlashTokenCandidateGenerator``: the DFlash drafter's cache). Both are
    ``DynamicCache`` subclasses that shift ``get_query_offset`` / ``get_mask_sizes``.

    * MtpCache declares only ``crop``: it is no model's own cache (``MTP_NOTE``), so every family that runs it as
      one skips, and ``check_speculative_mtp`` runs it as the MTP layers' cache, on models with MTP layers
      (``has_mtp_layers``).
    * DFlashCache shifts by the tokens the last step accepted (``set_previous_accepted_tokens``), 0 until the
      DFlash generator sets it: as a model's own cache it is a ``DynamicCache`` and is checked as one by every
      family (full tier: the default run has DynamicCache).

    Both skip, naming what is missing, on a transformers without them."""
    mtp_caps = frozenset({"crop"})
    return [
        CacheSpec("MtpCache", _mtp, capabilities=mtp_caps, applies_to=has_mtp_layers,
                  notes={name: MTP_NOTE for name in CAPABILITIES if name not in mtp_caps},
                  requires={"transformers.cache_utils:MtpCache": "MtpCache is not in the installed transformers "
                                                                 "(added in 5.25)"}),
        CacheSpec("DFlashCache", _dflash, tier="full",
                  requires={"transformers.cache_utils:DFlashCache": "DFlashCache is not in the installed "
                                                                    "transformers (added in 5.25)"}),
    ]


# ---------------------------------------------------------------------------------------------------- lossy, offloaded
def full_attention_only(model) -> str | None:
    """``CacheSpec.applies_to`` of QuantizedCache subjects: decoder-only, every layer full attention."""
    if model.is_encoder_decoder:
        return ("QuantizedCache supports decoder-only full-attention models only (transformers' generate refuses "
                "it for encoder-decoder models)")
    other = sorted(set(model.layer_types) - {"full_attention"})
    if other:
        return f"QuantizedCache supports full-attention models only ({model.name} has {', '.join(other)} layers)"
    return None


_REQUIRES = {
    "quanto": {"optimum.quanto": "pip install kvconform[quanto]"},
    "hqq": {"hqq": "pip install kvconform[hqq]"},
    "fp8": {"transformers.cache_utils:Fp8QuantizedLayer":
            "the fp8 backend of QuantizedCache is not in the installed transformers"},
}


_CUDA_REQUIRES = {
    "quanto": {"nvcc": "optimum-quanto builds its CUDA kernels with nvcc on first use, minutes of a GPU call"},
}


QUANTIZED_BUDGETS = {
    "QuantizedCache_quanto4": Budget(kl_max=5e-3, top1_min=0.75, bytes_ratio_max=0.25),
    "QuantizedCache_quanto2": Budget(kl_max=0.15, top1_min=0.4, bytes_ratio_max=0.16),
    "QuantizedCache_hqq4": Budget(kl_max=1.5e-2, top1_min=0.7, bytes_ratio_max=0.25),
    "QuantizedCache_hqq2": Budget(kl_max=0.4, top1_min=0.2, bytes_ratio_max=0.16),
    "QuantizedCache_fp8": Budget(kl_max=1e-3, top1_min=0.85, bytes_ratio_max=0.3),
}
"""Budgets of the built-in quantized subjects, by subject name, calibrated on the quality family's long cases
(``quality_long`` / ``compression_long``: 240 tokens, fp32, batch 2) on llama / gpt2 / phi3 with transformers 5.24,
optimum-quanto 0.2.7 and hqq 0.2.8 (the fake-quant twins measure the same, bit for bit). Measured, then budget:

* quanto 4-bit: KL 1.0e-3 / 1.4e-4 / 9.5e-4, top-1 0.930 / 0.984 / 0.859 → KL 5e-3, top-1 0.75;
* HQQ 4-bit: KL 2.9e-3 / 2.8e-4 / 2.2e-3, top-1 0.875 / 0.992 / 0.891 → KL 1.5e-2, top-1 0.70;
* quanto 2-bit: KL 3.3e-2 / 3.1e-3 / 3.0e-2, top-1 0.688 / 0.914 / 0.578 → KL 0.15, top-1 0.40;
* HQQ 2-bit: KL 6.0e-2 / 9.2e-3 / 5.7e-2, top-1 0.523 / 0.820 / 0.547 → KL 0.4, top-1 0.20 (a 272-token variant of
  the case measured up to KL 0.12, top-1 0.36);
* fp8: KL 2.7e-4 / 1.0e-5 / 2.7e-4, top-1 0.953 / 1.000 / 0.938 → KL 1e-3, top-1 0.85;
* bytes held / an exact cache's: 4-bit 0.1875 (llama, phi3: group 32) / 0.156 (gpt2: group 64), i.e. 4 bits plus a
  float32 scale and shift per group, for quanto and HQQ alike; 2-bit 0.125 / 0.094; fp8 0.250 (8 of 32 bits and one
  frozen scale per layer) → 0.25, 0.16 and 0.30.

Margins: about 4× on KL, 0.1–0.15 on top-1 (a tiny random model's margins are small: at 2 bits a third of the tokens
flip at a KL of 0.05, so KL is the sharp bound), and byte ratios that storage at the next larger width would exceed
(4-bit stored as 8-bit: 0.31 > 0.25; 2-bit stored as 4-bit: 0.19 > 0.16). The byte ratios are of float32 keys and
values. A subject declaring quanto 4-bit that stores its keys at 2 bits is over its budget
(tests/lossy/test_quantized.py).
"""


def quantized_subjects() -> list:
    """The built-in ``QuantizedCache`` subjects (quanto 4/2-bit, HQQ 4/2-bit, fp8), each with its twin.

    Capabilities: forward, generate, reorder, reset, batch_repeat, batch_select (the Cache API offers them; on 5.24
    they are broken for quantized layers, a known fault); deepcopy except quanto (``copy.deepcopy`` of quanto's
    wrapper tensors raises). No crop (``is_croppable`` is False), no compile.
    """
    from kvconform.quant import QUANTIZED, quantized_factory, twin_factory

    out = []
    for name, qc in QUANTIZED:
        caps = {"forward", "generate", "reorder", "reset", "batch_repeat", "batch_select"}
        caps |= {"deepcopy"} if qc.backend != "quanto" else set()
        out.append(CacheSpec(name, quantized_factory(qc), capabilities=frozenset(caps), twin=twin_factory(qc),
                             kind="lossy", budget=QUANTIZED_BUDGETS[name],
                             applies_to=full_attention_only, requires=_REQUIRES[qc.backend],
                             cuda_requires=_CUDA_REQUIRES.get(qc.backend, {}),
                             tier="full" if qc.nbits == 2 else "default"))
    return out


def _offloaded_dynamic(config):
    from transformers import DynamicCache

    return DynamicCache(config=config, offloading=True)


def _offloaded_static(config, max_cache_len):
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=max_cache_len, offloading=True)


OFFLOAD_REASON = "offloading needs CUDA"

OFFLOAD_COMPILE_NOTE = ("an offloaded cache moves each layer's tensors between the GPU and the CPU at every step "
                        "(offload / prefetch rebind them with .to(...)): they have no static address for CUDA graphs, "
                        "whatever is_compileable says")


def offloaded_deepcopy_note() -> dict:
    """``{"deepcopy": reason}`` where ``copy.deepcopy`` of a fresh offloaded cache raises on the installed
    transformers (5.25's ``Cache.__init__`` keeps a ``torch.Stream`` in ``prefetch_stream``, which cannot be
    pickled), else ``{}``. Tried once per process on a fresh ``DynamicCache(offloading=True)``, which builds
    without a GPU."""
    import copy

    from kvconform import compat
    from kvconform.memo import MEMO

    memo = MEMO.table("builtin.offloaded_deepcopy")
    if "note" not in memo:
        from transformers import DynamicCache

        try:
            fresh = DynamicCache(offloading=True)
        except Exception:  # noqa: BLE001 - not buildable here: the items report it themselves
            fresh = None
        try:
            copy.deepcopy(fresh)
            memo["note"] = {}
        except Exception as exc:  # noqa: BLE001 - what the fork would raise is the note
            memo["note"] = {"deepcopy": f"copy.deepcopy of an offloaded cache raises {type(exc).__name__}: "
                                        f"{str(exc)[:120]} on transformers {compat.transformers_version()} (the "
                                        f"cache keeps its prefetch stream)"}
    return dict(memo["note"])


def offloaded_subjects() -> list:
    """``DynamicCache(offloading=True)`` and ``StaticCache(offloading=True)``: CUDA only (skipped elsewhere), each
    declaring the non-offloaded subject it must equal (``same_as``). Neither declares ``deepcopy`` where
    ``copy.deepcopy`` of it raises (``offloaded_deepcopy_note``) nor ``compile`` (``OFFLOAD_COMPILE_NOTE``: 5.25
    says ``is_compileable`` for an offloaded StaticCache, and for an offloaded DynamicCache on Mamba, whose layers
    still move; the note also skips the checks of that claim, ``checks/_compiled.compile_applies``); the static one
    declares no batch ops."""
    fork = {**offloaded_deepcopy_note(), "compile": OFFLOAD_COMPILE_NOTE}
    notes = {**static_crop_note(), **fork}
    return [
        CacheSpec("DynamicCache_offloaded", _offloaded_dynamic, needs_cuda=OFFLOAD_REASON, same_as="DynamicCache",
                  capabilities=frozenset(CAPABILITIES) - set(fork), notes=fork),
        CacheSpec("StaticCache_offloaded", _offloaded_static, needs_cuda=OFFLOAD_REASON, same_as="StaticCache",
                  capabilities=frozenset(CAPABILITIES) - {"batch_repeat", "batch_select"} - set(notes), notes=notes),
    ]


BUILTIN_NAMES = ("ReferenceCache", "DynamicCache", "StaticCache", "QuantizedCache_quanto4", "QuantizedCache_quanto2",
                 "QuantizedCache_hqq4", "QuantizedCache_hqq2", "QuantizedCache_fp8", "DynamicCache_offloaded",
                 "StaticCache_offloaded", "MtpCache", "DFlashCache")
"""The names of ``builtin_subjects()``, in its order, readable without importing torch (an xdist controller checks
``--kvconform-subject`` against them before its workers start: ``options.refuse_bad_subjects``).
``tests/subjects`` holds them equal to the built list."""


def builtin_subjects() -> list[CacheSpec]:
    """ReferenceCache, DynamicCache(config=…), StaticCache(config=…, max_cache_len=…), the QuantizedCache
    subjects, the offloaded caches and MtpCache / DFlashCache (``quantized_subjects``, ``offloaded_subjects``,
    ``speculative_subjects``)."""
    notes = static_crop_note()
    return [
        CacheSpec("ReferenceCache", _reference),
        CacheSpec("DynamicCache", _dynamic),
        # StaticCache inherits Cache.batch_repeat_interleave / batch_select_indices, so it claims them; its layers
        # lack them on transformers 5.24 (known_faults.toml), which the contract and batch families report. It
        # does not claim crop where its layers have none at all (before 5.24).
        CacheSpec("StaticCache", _static, capabilities=frozenset(CAPABILITIES) - set(notes), notes=notes),
        *quantized_subjects(),
        *offloaded_subjects(),
        *speculative_subjects(),
    ]
