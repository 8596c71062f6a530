"""Refusals and snapshots: whether an exception is a *clear* refusal, whether the contract *allows* it
(``allowed_refusal``), and proof that a refused call changed nothing.

Shared by the families that judge a refusal (crop, contract, lifecycle, prefix, evicting), so that no family module
imports another.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconform.checks._drive import SubjectRaised, seq_length
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


@dataclass(frozen=True)
class Allowance:
    """Whether a clear refusal is the contract's (``allowed_refusal``).

    Attributes:
        by: who refused and why that is allowed (``"subject, declared: <why>"``, ``"subject and ReferenceCache"``,
            ``"subject (model adapter contract: ...)"``), or None: not allowed.
        reference: the reference's name (for a failure's message), or ``"the reference"``.
    """

    by: str | None
    reference: str = "the reference"


def allowed_refusal(ctx, refusal: str, run_reference, adapter_contract: str | None = None) -> Allowance:
    """Whether the subject's clear refusal named ``refusal`` (a name of ``spec.REFUSALS``) is allowed by the
    contract: the subject declares it (``CacheSpec.refuses``), or the reference (``ctx.reference``) cannot do it
    either — ``run_reference(ref_ctx)`` runs the same case on a fresh reference cache (``ref_ctx``: this context with
    the reference as its subject, its own metrics and record) and raises ``SubjectRaised`` where it refuses too.
    A model written from scratch has no reference; its documented contract (``adapter_contract``) allows the refusal
    where one is given. A refusal that is none of these is a fault the item must report (a cache that refuses what
    the simplest correct cache does is not conforming, however clear its message)."""
    from kvconform.checks._registry import Measured

    declared = dict(ctx.subject.refuses or {})
    if refusal in declared:
        return Allowance(f"subject, declared: {declared[refusal]}")
    if ctx.reference is None:
        return Allowance(f"subject (model adapter contract: {adapter_contract})" if adapter_contract else None)
    ref_ctx = ctx.replace(subject=ctx.reference, metrics={}, measured=Measured())
    try:
        run_reference(ref_ctx)
    except SubjectRaised:
        return Allowance(f"subject and {ctx.reference.name}", ctx.reference.name)
    return Allowance(None, ctx.reference.name)
