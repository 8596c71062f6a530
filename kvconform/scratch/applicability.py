"""What does not apply to a model written from scratch, and why: by what the adapter declares: left-padded cases
without a padding mask, the length bookkeeping without ``seq_length``, a dtype its model fails at whatever the cache.
(A check that judges transformers' own API, or that a from-scratch model gets in the full tier only, says so itself:
``register(..., transformers_only=reason)``, ``register(..., adapter_full_tier=reason)``; ``kvconform.sources``.)"""

from __future__ import annotations

import functools

from kvconform.scratch.adapter import is_encoder_decoder, load_adapter, takes_mask, vocab_size


def _torch():
    import torch

    return torch


def not_applicable(check, case, spec: str | None = None) -> str | None:
    """Why ``check`` (a registered check) on ``case`` cannot apply to a from-scratch model (the adapter ``spec``
    names), by what the adapter declares, or None: a left-padded case where its forward takes no mask, the length
    bookkeeping without ``seq_length``, a dtype its model fails at whatever the cache, explicit ``position_ids``.
    (A check judging transformers' own API says so itself, ``CheckInfo.transformers_only``, read by the adapter's
    model source first: ``kvconform.sources.adapter``.)"""
    if case.params.get("padding") and spec is not None and not takes_mask(load_adapter(spec)):
        twin = unpadded_twin(case.id)
        return ("the model adapter declares takes_mask = False: its forward takes no padding mask ("
                + (f"its unpadded twin {twin} runs instead" if twin else "this case checks left-padded rows "
                   "themselves and has no unpadded twin")
                + "; a forward taking mask [B, start + T], 1 real / 0 left pad, runs this one too)")
    if check.name == "check_length_bookkeeping" and spec is not None \
            and not callable(getattr(load_adapter(spec), "seq_length", None)):
        return ("the model adapter defines no seq_length(cache): kvconform would compare its own count of tokens "
                "fed with itself — define seq_length(cache) (the tokens your cache says it holds) to have it checked "
                "after every op, with capacity(cache) stable over the cache's life (transformers' get_mask_sizes / "
                "update() bookkeeping has no counterpart in an adapter)")
    if spec is not None and case.dtype in ("bfloat16", "float16") and (problem := dtype_problem(spec, case.dtype)):
        return problem
    if case.position_ids == "explicit":
        return ("not for a model outside transformers: its positions come from the start offset the adapter is "
                "given, not from position_ids (nothing for the adapter to add: the implicit-positions twin runs)")
    return None


@functools.lru_cache(maxsize=None)
def dtype_problem(spec: str, dtype: str) -> str | None:
    """Why the adapter's model cannot run at ``dtype`` (``"bfloat16"`` / ``"float16"``) whatever the cache, or None:
    ``build(dtype, "cpu")`` or its uncached forward of 2 rows × 6 tokens (no cache, no mask) raises or returns
    NaN/inf. Measured once per model and dtype when the plan is made; the items at that dtype skip with this reason,
    the model's, instead of failing on every cache."""
    torch = _torch()
    adapter = load_adapter(spec)
    what = type(adapter).__name__
    try:
        net = adapter.build(dtype=getattr(torch, dtype), device="cpu")
        ids = (torch.arange(12).view(2, 6) * 7 + 3) % vocab_size(adapter)
        with torch.no_grad():
            extra = ({"encoder": adapter.encode(net, (torch.arange(10).view(2, 5) * 5 + 1) % vocab_size(adapter))}
                     if is_encoder_decoder(adapter) else {})
            logits = adapter.forward_uncached(net, ids, **extra)
    except Exception as exc:  # noqa: BLE001 - the model's own failure: the reason
        return (f"the model fails at {dtype} whatever the cache: its uncached forward (forward_uncached, no cache) "
                f"at {dtype} raised {type(exc).__name__}: {str(exc)[:200]} — the model's fault, judged on no cache "
                f"(make every dtype inside {what}'s forward follow the weights', e.g. rotary tables cast to the "
                f"input's dtype)")
    if isinstance(logits, torch.Tensor) and logits.is_floating_point() and not bool(torch.isfinite(logits).all()):
        return (f"the model fails at {dtype} whatever the cache: its uncached forward (forward_uncached, no cache) "
                f"at {dtype} returns NaN/inf logits — the model's fault, judged on no cache")
    return None


def unpadded_twin(case_id: str) -> str | None:
    """The id of the built-in unpadded twin of the left-padded case ``case_id`` (``reorder_padded`` →
    ``reorder_unpadded``, ``bf16_long_decode`` → ``bf16_long_decode_unpadded``), or None when there is none."""
    twin = case_id.removesuffix("_padded") + "_unpadded"
    return twin if twin in _builtin_case_ids() else None


@functools.lru_cache(maxsize=1)
def _builtin_case_ids() -> frozenset:
    from kvconform.cases import load_cases

    return frozenset(case.id for case in load_cases())


