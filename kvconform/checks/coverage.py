"""Family ``coverage``: what transformers offers is covered.

* ``check_cache_implementation``: ``generate(cache_implementation=X)`` builds the cache of the subject the case names
  (same class, same layer classes) and decodes like ``generate(use_cache=False)`` (like the lossy subject's
  fake-quant twin for ``"quantized"``).
* ``check_cache_implementations_covered`` / ``check_layer_types_covered``: the drift detector. They read
  ``ALL_CACHE_IMPLEMENTATIONS`` and the layer-type mappings of the *installed* transformers and fail, naming it, on
  every string or layer type that kvconform does not cover, so an upgrade cannot add an untested cache silently.
"""

from __future__ import annotations

from typing import Any

from kvconform import compat
from kvconform.checks import IGNORES_OPS, Param, register
from kvconform.checks._drive import SubjectRaised, generate, generate_prompt
from kvconform.checks._measure import layer_list, read_attr, self_half
from kvconform.checks._diagnosis import describe_raise
from kvconform.oracle import compare_logits

TRANSFORMERS_ONLY = "the coverage family checks transformers' cache_implementation strings and layer table"
"""Why no check of this family applies to a model outside transformers (``register(..., transformers_only=...)``)."""


def _implementation_row(subject, model, case, device="cpu"):
    expected = case.params.get("subject")
    if not isinstance(expected, str) or not isinstance(case.params.get("implementation"), str):
        return None  # reported by the check itself (a malformed case)
    if subject.name != expected:
        return (f"cache_implementation={case.params['implementation']!r} builds {expected}: "
                f"this item runs on that subject's row")
    from transformers.generation import configuration_utils

    if case.params["implementation"] not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS:
        return (f"transformers {compat.transformers_version()} has no cache_implementation="
                f"{case.params['implementation']!r}")
    return None


def _reference_row(subject, model, case, device="cpu"):
    if subject.name != "ReferenceCache":
        return "describes the installed transformers, not a subject: it runs once, on the ReferenceCache row"
    return None


def _generate(ctx, **kwargs):
    """Greedy generate of ``case.max_new_tokens`` after a seeded prompt (``generate_prompt``: a VLM's starts with
    its image); ``(prompt, sequences, step logits, out)``."""
    model, case = ctx.model, ctx.case
    prompt = generate_prompt(model, case)
    seq, logits, out = generate(model, prompt, case.max_new_tokens, kwargs)
    return prompt, seq, logits, out


def _layer_classes(cache) -> tuple:
    """``(cache class, self-attention layer classes, cross-attention layer classes or ())``."""
    cross = read_attr(cache, "cross_attention_cache")
    main = self_half(cache)
    return (type(main).__name__, tuple(type(layer).__name__ for layer in layer_list(main)),
            tuple(type(layer).__name__ for layer in layer_list(cross)) if cross is not None else ())


@register("coverage", needs=("generate",), applies=_implementation_row, ops=IGNORES_OPS,
          transformers_only="transformers' generate(cache_implementation=...)", params={
    "implementation": Param(str, required=True, doc="a cache_implementation string of generate()"),
    "subject": Param(str, required=True, doc="the subject whose cache it must build"),
})
def check_cache_implementation(ctx):
    """``generate(cache_implementation=X)`` builds the same cache as the subject the case names and generates what
    ``generate(use_cache=False)`` does (for a lossy subject: what ``generate(cache=twin)`` does), step logits
    within the tolerance of the oracle (of the twin)."""
    params, case = ctx.case.params, ctx.case
    impl, expected_subject = params.get("implementation"), params.get("subject")
    if not isinstance(impl, str) or not isinstance(expected_subject, str):
        raise ValueError(f"case {case.id}: check_cache_implementation needs params = {{implementation = '<string>', "
                         f"subject = '<subject name>'}}")
    kwargs: dict[str, Any] = {"cache_implementation": impl}
    qc = getattr(ctx.subject.factory, "quant_config", None)
    if impl == "quantized" and qc is not None:
        from kvconform.quant import group_size_for

        kwargs["cache_config"] = ({"backend": "fp8"} if qc.backend == "fp8" else {
            "backend": qc.backend, "nbits": qc.nbits, "axis_key": qc.axis_key, "axis_value": qc.axis_value,
            "q_group_size": qc.q_group_size or group_size_for(ctx.model.config),
            "residual_length": qc.residual_length})
    ctx.metrics.update(implementation=impl)
    try:
        prompt, seq, logits, out = _generate(ctx, **kwargs)
    except Exception as exc:  # noqa: BLE001
        err = SubjectRaised("generate", exc)
        ctx.fail([f"generate(cache_implementation={impl!r}) raised {describe_raise(err)}",
                  f"ops: generate(greedy, max_new_tokens={case.max_new_tokens})",
                  f"likely cause: transformers no longer builds a working cache for {impl!r} on this model"],
                 {"raised": type(exc).__name__})
    built = _layer_classes(compat.output_cache(out))
    expected = _layer_classes(ctx.new_cache())
    if built != expected and len(built[1]) > len(expected[1]):
        # a model that adds cache layers in its own forward (dory's per-loop copies of its recurrent layers): what
        # the subject's cache holds after the same generate is what the implementation should have built
        try:
            own = _generate(ctx, **compat.generate_cache_kwargs(ctx.new_cache(), ctx.model.model))[3]
            expected = _layer_classes(compat.output_cache(own))
        except Exception:  # noqa: BLE001 - the subject's own generate fails elsewhere; compare with the fresh one
            pass
    ctx.metrics.update(built=built[0], layers=list(built[1]))
    if built != expected:
        ctx.fail([f"generate(cache_implementation={impl!r}) built {built[0]} with layers {list(built[1])}"
                  + (f" / cross {list(built[2])}" if built[2] else ""),
                  f"but should build what {expected_subject} builds: {expected[0]} with layers {list(expected[1])}"
                  + (f" / cross {list(expected[2])}" if expected[2] else ""),
                  f"likely cause: transformers changed what {impl!r} means; update coverage.toml (and test the new "
                  f"cache as its own subject)"])
    twin = ctx.kind.twin_spec()
    if twin is not None:
        _, ref_seq, ref_logits, _ = _generate(ctx, **compat.generate_cache_kwargs(ctx.new_cache(twin), ctx.model.model))
        reference = "generate(cache=fake-quant twin)"
    else:
        _, ref_seq, ref_logits, _ = _generate(ctx, use_cache=False)
        reference = "generate(use_cache=False)"
    same = seq.shape == ref_seq.shape and bool((seq == ref_seq).all())
    n = case.max_new_tokens
    enc = prompt if ctx.model.is_encoder_decoder else None
    first = 0 if ctx.model.is_encoder_decoder else prompt.shape[1] - 1
    sl = slice(first, first + n)
    oracle = ctx.oracle.logits(seq[:, :-1], encoder_ids=enc)[:, sl]
    uncached = ctx.oracle.uncached(seq[:, :-1], encoder_ids=enc)[:, sl]
    if twin is not None:  # target: the twin's step logits; noise floor: the oracle's (float noise of the exact path)
        cmp = compare_logits(logits, ref_logits, ref_logits + (uncached - oracle), ctx.tolerance()) if same \
            else None
    else:
        cmp = compare_logits(logits, oracle, uncached, ctx.tolerance())
    ctx.metrics.update(tokens_equal=same, compared_with=reference)
    if cmp is not None:
        ctx.metrics.update(max_abs=cmp.max_abs, tolerance=cmp.tol, noise_floor=cmp.floor)
    if same and cmp is not None and cmp.passed:
        return
    lines = []
    if cmp is not None and not cmp.passed:
        lines.append(f"max|Δlogit| = {cmp.max_abs:.1e}, but should be ≤ {cmp.tol:.1e} "
                     f"({ctx.tolerance().describe(cmp.floor)})")
    if not same:
        lines.append(f"generate(cache_implementation={impl!r}) tokens differ from {reference}")
    lines += [f"ops: generate(prompt {prompt.shape[1]}, greedy, max_new_tokens={n}); built {built[0]}",
              f"likely cause: the cache transformers builds for {impl!r} (or how generate() drives it) differs from "
              f"{expected_subject} used directly"]
    ctx.fail(lines)


def covered_implementations() -> dict:
    """``{implementation string: subject name}`` of the built-in ``check_cache_implementation`` cases."""
    from kvconform.cases import load_cases

    return {c.params["implementation"]: c.params.get("subject") for c in load_cases()
            if c.check == "check_cache_implementation" and "implementation" in c.params}


@register("coverage", applies=_reference_row, ops=IGNORES_OPS, transformers_only=TRANSFORMERS_ONLY)
def check_cache_implementations_covered(ctx):
    """Every string of the installed ``transformers.generation.configuration_utils.ALL_CACHE_IMPLEMENTATIONS`` has a
    ``check_cache_implementation`` case; a new one fails here, named."""
    from transformers.generation import configuration_utils

    listed = tuple(configuration_utils.ALL_CACHE_IMPLEMENTATIONS)
    covered = covered_implementations()
    missing = [s for s in listed if s not in covered]
    stale = sorted(set(covered) - set(listed))
    ctx.metrics.update(listed=list(listed), covered=sorted(covered), missing=missing, stale=stale)
    if missing:
        ctx.fail([f"cache_implementation string(s) not covered by kvconform: {', '.join(map(repr, missing))}",
                  f"transformers {compat.transformers_version()} lists {len(listed)}: {', '.join(listed)}",
                  "likely cause: a transformers upgrade added a cache kvconform does not test yet: add a "
                  "check_cache_implementation case to coverage.toml (and a subject for the cache it builds)"])


def _zoo_layer_types() -> dict:
    """``{layer type: [zoo models having it]}`` over the whole zoo (configs only, no weights)."""
    from kvconform import zoo

    out: dict = {}
    for name in zoo.ZOO_NAMES:
        types, _ = zoo._layer_types(zoo.zoo_config(name))
        for t in types:
            out.setdefault(t, []).append(name)
    return out


def _layer_table_row(subject, model, case, device="cpu"):
    if compat.layer_type_mappings() is None:
        return (f"transformers {compat.transformers_version()} has no table of cache layer types "
                "(DYNAMIC_LAYER_TYPE_MAPPING): DynamicCache/StaticCache map the types inline, so there is no list "
                "to cover")
    return _reference_row(subject, model, case, device=device)


@register("coverage", applies=_layer_table_row, ops=IGNORES_OPS, transformers_only=TRANSFORMERS_ONLY,
          params={"gaps": Param(dict, default={}, items=str, doc="known gaps: {layer_type = \"reason\"}")})
def check_layer_types_covered(ctx):
    """Every layer type of the installed ``DYNAMIC_LAYER_TYPE_MAPPING`` / ``STATIC_LAYER_TYPE_MAPPING`` is covered:
    a zoo model has it, or another type mapped to the same dynamic and static layer classes, and ReferenceCache
    implements it. Gaps kvconform knows of are listed with their reason in the case's ``params.gaps``; any other
    uncovered type fails here, named."""
    from kvconform.reference import make_reference_layer

    gaps = ctx.case.params["gaps"]
    dyn, sta = compat.layer_type_mappings()
    listed = sorted(set(dyn) | set(sta))
    zoo_types = _zoo_layer_types()
    covered, missing, via = [], [], {}
    for t in listed:
        same = [z for z in zoo_types if dyn.get(z) is dyn.get(t) and sta.get(z) is sta.get(t)]
        try:
            make_reference_layer(t, {})
            reference = True
        except ValueError:
            reference = False
        if same and reference:
            covered.append(t)
            via[t] = sorted({m for z in same for m in zoo_types[z]})[:3]
        elif t not in gaps:
            missing.append(t)
    ctx.metrics.update(listed=listed, covered=covered, known_gaps=sorted(set(listed) & set(gaps)), missing=missing,
                       stale_gaps=sorted(set(gaps) - set(listed)))
    if missing:
        ctx.fail([f"layer type(s) not covered by kvconform: {', '.join(map(repr, missing))}",
                  f"covered: {', '.join(covered)}; known gaps: {', '.join(sorted(set(listed) & set(gaps))) or '-'}",
                  "likely cause: a transformers upgrade added a cache layer type (or mapped a type to a new class): "
                  "add a zoo model that has it and a ReferenceCache layer for it, or list it under gaps in "
                  "coverage.toml with the reason"])
