"""Refusals and snapshots: whether an exception is a *clear* refusal, and proof that a refused call changed nothing.

Shared by the families that judge a refusal (crop, contract, lifecycle, prefix, evicting), so that no family module
imports another.
"""

from __future__ import annotations

from kvconform.checks._drive import seq_length
from kvconform.checks._measure import tensors_of

RAW_ERRORS = (IndexError, KeyError, AttributeError, ZeroDivisionError)
CROP_WORDS = ("crop", "croppable", "record", "roll", "window", "recurrent", "cannot", "not supported", "negative",
              "positive", "only", "dynamic")


def clear_error(exc: BaseException, words) -> bool:
    """A *clear* error: not one of the raw errors a tensor op throws (``IndexError``, ``KeyError``, ...), and a
    message that names the problem (contains one of ``words``, case-insensitive)."""
    if isinstance(exc, RAW_ERRORS):
        return False
    text = str(exc).lower()
    return any(w.lower() in text for w in words)


def snapshot(cache) -> dict:
    """``{name: clone}`` of every tensor the cache holds, plus its reported length (to prove a refusal changed
    nothing)."""
    state = {name: t.detach().clone() for name, t in tensors_of(cache).items()}
    state["get_seq_length()"] = seq_length(cache)
    return state


def same_tensor(a, b) -> bool:
    """Bit-for-bit equality of two tensors where NaN equals NaN (a slot that held NaN and still does is unchanged;
    ``torch.equal`` would call it changed)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point() and not a.is_complex():
        return torch.equal(a, b)
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def changed(before: dict, after: dict) -> list[str]:
    """Names whose tensor (shape or value, NaN equal to NaN) or reported length differ between two snapshots; a
    tensor that holds NaN/inf after is named ``"name (now non-finite)"``."""
    import torch

    out = []
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if not same_tensor(a, b):
                bad = b.is_floating_point() and not bool(torch.isfinite(b).all())
                out.append(name + (" (now non-finite)" if bad else ""))
        elif a != b:
            out.append(name)
    return out
