"""Applicability of the checks that compile a cache (the compile family, and the speed family's compiled timing):
the ``is_compileable`` a subject's cache declares (built once per subject and model, on a weightless config), and
CUDA-only cases.

Shared so that no family module imports another.
"""

from __future__ import annotations

from kvconform.memo import MEMO

_CLAIMS: dict = MEMO.table("compile.claims")
"""``{(subject, source, model spec): is_compileable or None}``: memo of ``declared_compileable`` for the run."""


def declared_compileable(subject, model_info) -> bool | None:
    """``is_compileable`` of ``subject``'s cache built for ``model_info``'s config (no tensors allocated;
    ``CacheSpec.plan_build``), memoised; None when it cannot be built here (then the item runs and reports the
    failure)."""
    if getattr(subject, "adapter_spec", ""):  # a model adapter's cache: the compiled decode step it declares
        return getattr(subject, "compileable", None) is True
    key = (subject.name, subject.source, model_info.spec)
    if key not in _CLAIMS:
        try:
            config = model_info.model_config()  # its source reads it
            cache = subject.plan_build(config)
            _CLAIMS[key] = bool(cache.is_compileable)
        except Exception:  # noqa: BLE001 - reported by the item itself
            _CLAIMS[key] = None
    return _CLAIMS[key]


def _device_rule(case, device) -> str | None:
    """Why a ``params.device = "cuda"`` case does not run on ``device``, or None."""
    if case.params.get("device") == "cuda":
        from kvconform.compat import on_cuda

        if not on_cuda(device):
            return (f"case {case.id} requires CUDA (mode={case.params.get('mode')!r}: CUDA graphs); "
                    f"run with --kvconform-device cuda on a GPU")
    return None


def compile_applies(claim: bool):
    """The applicability rule of a check of the ``is_compileable`` claim ``claim`` (``register(applies=...)``): a
    CUDA-only case skips off CUDA; for the claim True, a subject that does not declare ``compile`` and says why
    (``CacheSpec.notes["compile"]``) is skipped with that note; a subject declaring the other claim is skipped (the
    other check tests it)."""
    def rule(subject, model, case, device="cpu"):
        reason = _device_rule(case, device)
        if reason:
            return reason
        note = subject.notes.get("compile")
        if claim and note and "compile" not in subject.capabilities:
            # the subject says why it is not a compileable cache (an offloaded cache moves its tensors every step):
            # its is_compileable is not the claim these checks test
            return f"{subject.name} does not declare capability 'compile': {note}"
        declared = declared_compileable(subject, model)
        if declared is not None and declared != claim:
            other = "check_compile_static_decode" if declared else "check_compile_claim"
            return (f"{subject.name} on {model.name} declares is_compileable={declared}; "
                    f"this check is for is_compileable={claim} ({other} tests it)")
        return None

    return rule
