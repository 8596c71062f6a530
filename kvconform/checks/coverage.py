"""Coverage of what transformers offers, and the caches tied to hardware or to model structure.

* ``check_cache_implementation`` (coverage): ``generate(cache_implementation=X)`` builds the cache of the subject the
  case names (same class, same layer classes) and decodes like ``generate(use_cache=False)`` (like the lossy
  subject's fake-quant twin for ``"quantized"``).
* ``check_cache_implementations_covered`` / ``check_layer_types_covered`` (coverage): the drift detector. They read
  ``ALL_CACHE_IMPLEMENTATIONS`` and the layer-type mappings of the *installed* transformers and fail, naming it, on
  every string or layer type that kvconform does not cover, so an upgrade cannot add an untested cache silently.
* ``check_encoder_decoder_subcaches`` (contract): in an ``EncoderDecoderCache`` the cross-attention sub-cache holds
  the encoder states once, unchanged by decoding, and the self-attention sub-cache holds the decoder tokens fed.
* ``check_offloaded_matches`` (memory, CUDA): an offloaded cache gives the logits of its non-offloaded subject and a
  lower GPU peak while decoding.
* ``check_mamba_kernel_paths`` (logits, CUDA + ``[mamba]``): Mamba / Mamba2 through the mamba-ssm / causal-conv1d
  kernels and through transformers' torch fallbacks both match the oracle.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys

from kvconform import compat
from kvconform.checks import register
from kvconform.checks._engine import (SubjectRaised, case_generator, describe_raise, judge, random_tokens,
                                      run_ops)
from kvconform.oracle import Tolerance, compare_logits


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
    """Greedy generate of ``case.max_new_tokens`` after a seeded prompt; ``(prompt, sequences, step logits, out)``."""
    import torch

    model, case = ctx.model, ctx.case
    gen = case_generator(case, model.name)
    n = case.encoder_len if model.is_encoder_decoder else case.prompt
    prompt = random_tokens(gen, case.batch, n, model.vocab_size)
    device = next(model.model.parameters()).device
    with torch.no_grad():
        out = model.model.generate(
            prompt.to(device), attention_mask=torch.ones_like(prompt).to(device),
            max_new_tokens=case.max_new_tokens, min_new_tokens=case.max_new_tokens, do_sample=False,
            return_dict_in_generate=True, output_logits=True, **kwargs)
    logits = torch.stack([x.detach().to("cpu", torch.float64) for x in out.logits], dim=1)
    return prompt, out.sequences.cpu(), logits, out


def _layer_classes(cache) -> tuple:
    """``(cache class, self-attention layer classes, cross-attention layer classes or ())``."""
    inner = getattr(cache, "self_attention_cache", None)
    cross = getattr(cache, "cross_attention_cache", None)
    main = inner if inner is not None else cache
    return (type(main).__name__, tuple(type(layer).__name__ for layer in getattr(main, "layers", ())),
            tuple(type(layer).__name__ for layer in getattr(cross, "layers", ())) if cross is not None else ())


@register("coverage", needs=("generate",))
def check_cache_implementation(ctx):
    """``generate(cache_implementation=X)`` builds the same cache as the subject the case names and generates what
    ``generate(use_cache=False)`` does (for a lossy subject: what ``generate(cache=twin)`` does), step logits
    within the tolerance of the oracle (of the twin)."""
    params, case = ctx.case.params, ctx.case
    impl, expected_subject = params.get("implementation"), params.get("subject")
    if not isinstance(impl, str) or not isinstance(expected_subject, str):
        raise ValueError(f"case {case.id}: check_cache_implementation needs params = {{implementation = '<string>', "
                         f"subject = '<subject name>'}}")
    kwargs = {"cache_implementation": impl}
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
    ctx.metrics.update(built=built[0], layers=list(built[1]))
    if built != expected:
        ctx.fail([f"generate(cache_implementation={impl!r}) built {built[0]} with layers {list(built[1])}"
                  + (f" / cross {list(built[2])}" if built[2] else ""),
                  f"but should build what {expected_subject} builds: {expected[0]} with layers {list(expected[1])}"
                  + (f" / cross {list(expected[2])}" if expected[2] else ""),
                  f"likely cause: transformers changed what {impl!r} means; update coverage.toml (and test the new "
                  f"cache as its own subject)"])
    lossy = getattr(ctx.subject, "twin", None) is not None
    if lossy:
        import dataclasses

        twin = dataclasses.replace(ctx.subject, name=f"{ctx.subject.name}.twin", factory=ctx.subject.twin, twin=None)
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
    if lossy:  # target: the twin's step logits; noise floor: the oracle's (float noise of the exact path)
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


check_cache_implementation.kvconform_applies = _implementation_row


def covered_implementations() -> dict:
    """``{implementation string: subject name}`` of the built-in ``check_cache_implementation`` cases."""
    from kvconform.cases import load_cases

    return {c.params["implementation"]: c.params.get("subject") for c in load_cases()
            if c.check == "check_cache_implementation" and "implementation" in c.params}


@register("coverage")
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


check_cache_implementations_covered.kvconform_applies = _reference_row


def _zoo_layer_types() -> dict:
    """``{layer type: [zoo models having it]}`` over the whole zoo (configs only, no weights)."""
    from kvconform import zoo

    out: dict = {}
    for name in zoo.ZOO_NAMES:
        types, _ = zoo._layer_types(zoo.zoo_config(name))
        for t in types:
            out.setdefault(t, []).append(name)
    return out


@register("coverage")
def check_layer_types_covered(ctx):
    """Every layer type of the installed ``DYNAMIC_LAYER_TYPE_MAPPING`` / ``STATIC_LAYER_TYPE_MAPPING`` is covered:
    a zoo model has it, or another type mapped to the same dynamic and static layer classes, and ReferenceCache
    implements it. Gaps kvconform knows of are listed with their reason in the case's ``params.gaps``; any other
    uncovered type fails here, named."""
    from kvconform.reference import make_reference_layer

    gaps = ctx.case.params.get("gaps", {})
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


def _layer_table_row(subject, model, case, device="cpu"):
    if compat.layer_type_mappings() is None:
        return (f"transformers {compat.transformers_version()} has no table of cache layer types "
                "(DYNAMIC_LAYER_TYPE_MAPPING): DynamicCache/StaticCache map the types inline, so there is no list "
                "to cover")
    return _reference_row(subject, model, case, device=device)


check_layer_types_covered.kvconform_applies = _layer_table_row


# ------------------------------------------------------------------------------------------ encoder-decoder
@register("contract", needs=("forward",))
def check_encoder_decoder_subcaches(ctx):
    """In the ``EncoderDecoderCache`` built from the subject: after every forward the cross-attention sub-cache
    holds ``encoder_len`` tokens, its keys/values unchanged since the first forward, and the self-attention
    sub-cache holds the decoder tokens fed; every step's logits equal the oracle."""
    import torch

    if not ctx.model.is_encoder_decoder:
        raise ValueError(f"case {ctx.case.id}: check_encoder_decoder_subcaches needs requires = ['encoder_decoder']")
    cache = ctx.new_cache()
    first_cross, problems, fed = [], [], [0]

    def cross_state():
        return [(layer.keys.clone(), layer.values.clone()) for layer in cache.cross_attention_cache.layers
                if getattr(layer, "keys", None) is not None and getattr(layer, "values", None) is not None]

    def observe(step):
        fed[0] += step.length
        cross_len, self_len = _length(cache.cross_attention_cache), _length(cache.self_attention_cache)
        if cross_len != ctx.case.encoder_len:
            problems.append(f"after {step.label}: cross-attention sub-cache holds {cross_len} tokens, but should "
                            f"hold the {ctx.case.encoder_len} encoder tokens")
        if self_len != fed[0]:
            problems.append(f"after {step.label}: self-attention sub-cache holds {self_len} tokens, but should "
                            f"hold the {fed[0]} decoder tokens fed")
        state = cross_state()
        if not first_cross:
            first_cross.extend(state)
        elif len(state) != len(first_cross) or any(
                not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])) for a, b in zip(first_cross, state)):
            problems.append(f"after {step.label}: cross-attention keys/values changed since the first forward")

    try:
        steps = _run_observed(ctx, cache, observe)
    except SubjectRaised as exc:
        ctx.fail([f"the subject raised {describe_raise(exc)}", f"ops: {ctx.case.ops_label()}",
                  "likely cause: the subject cannot serve as one half of an EncoderDecoderCache"])
    from kvconform.checks.quality import oracle_slices

    exact, tol = oracle_slices(ctx, steps), ctx.tolerance()
    cmps = [(step, compare_logits(step.logits, *exact[step.index], tol)) for step in steps]
    worst = max(cmps, key=lambda sc: sc[1].max_abs)[1]
    ctx.metrics.update(max_abs=worst.max_abs, tolerance=worst.tol, noise_floor=worst.floor, steps=len(steps),
                       cross_layers_compared=len(first_cross))
    bad = next(((step, c) for step, c in cmps if not c.passed), None)
    if bad is not None:
        step, c = bad
        problems.insert(0, f"max|Δlogit| = {c.max_abs:.1e} at {step.label}, but should be ≤ {c.tol:.1e} "
                           f"({tol.describe(c.floor)})")
    if problems:
        if any("self-attention" in p for p in problems):
            cause = ("get_seq_length() of the self-attention sub-cache does not count the decoder tokens it stores "
                     "(the model derives decoder positions from it)")
        elif any("cross-attention" in p for p in problems):
            cause = ("the cross-attention sub-cache is written to again (appended, cleared or modified in place) "
                     "while decoding; it must hold the encoder states exactly once")
        else:
            cause = "the subject mishandles one half of the EncoderDecoderCache (see the logits family)"
        ctx.fail([*problems[:3], f"ops: {ctx.case.ops_label()} (encoder input {ctx.case.encoder_len} tokens)",
                  "likely cause: " + cause])


def _length(cache):
    try:
        return int(cache.get_seq_length())
    except Exception:  # noqa: BLE001
        return None


# ------------------------------------------------------------------------------------------ offloading (CUDA)
def _offloaded_row(subject, model, case, device="cpu"):
    if getattr(subject, "same_as", None) is None:
        return "applies to offloaded subjects only (a CacheSpec with same_as)"
    return None


def _deeper(zm, layers: int):
    """The zoo model's architecture with ``layers`` decoder layers (seeded weights, same device and dtype)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(zm.config)
    config.num_hidden_layers = layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    device = next(zm.model.parameters()).device
    return model.to(device=device, dtype=zm.dtype).eval()


@register("memory", needs=("forward",))
def check_offloaded_matches(ctx):
    """An offloaded subject (CUDA) decodes to the logits of the non-offloaded subject it names (``same_as``) and
    allocates less GPU memory at its decode peak, on a deeper copy of the model (``params.layers``, default 6) so
    that offloading has layers to move."""
    import copy
    import dataclasses

    import torch

    from kvconform.subjects import builtin_subjects

    baseline = next((s for s in builtin_subjects() if s.name == ctx.subject.same_as), None)
    if baseline is None:
        raise ValueError(f"{ctx.subject.name}: same_as names no built-in subject ({ctx.subject.same_as!r})")
    if not torch.cuda.is_available():  # the session's rule skips this item; a direct call must not pass
        raise RuntimeError("offloading needs CUDA")
    model = _deeper(ctx.model, int(ctx.case.params.get("layers", 6)))
    dctx = copy.copy(ctx)
    dctx.model = dataclasses.replace(ctx.model, model=model, config=model.config)
    prefill = next(op.n for op in ctx.case.ops if op.name == "prefill")
    runs = {}
    for spec in (baseline, ctx.subject):  # one after the other in this process: the same other allocations
        cache = spec.build(dctx.model, max_cache_len=dctx.max_cache_len, batch_size=ctx.case.batch)
        torch.cuda.synchronize()

        def after_prefill(step):
            if step.index == 0 and step.length == prefill:  # from here on: the decode peak
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        steps = _run_observed(dctx, cache, after_prefill)
        torch.cuda.synchronize()
        runs[spec.name] = (steps, torch.cuda.max_memory_allocated())
        del cache
    (base_steps, base_peak), (sub_steps, sub_peak) = runs[baseline.name], runs[ctx.subject.name]
    tol = Tolerance(1.0, 1e-6)
    worst = max(float((a.logits - b.logits).abs().max()) for a, b in zip(base_steps, sub_steps))
    ctx.metrics.update(max_abs=worst, tolerance=tol.abs_min, peak_bytes=sub_peak, baseline_peak_bytes=base_peak,
                       compared_with=baseline.name)
    problems = []
    if worst > tol.abs_min:
        problems.append(f"max|Δlogit| vs {baseline.name} = {worst:.1e}, but should be ≤ {tol.abs_min:.0e} "
                        f"(offloading only moves tensors)")
    if sub_peak >= base_peak:
        problems.append(f"GPU peak while decoding = {sub_peak} bytes, but should be below {baseline.name}'s "
                        f"{base_peak} bytes")
    if problems:
        ctx.fail([*problems, f"ops: {ctx.case.ops_label()} on {ctx.model.name} with {model.config.num_hidden_layers}"
                  f" layers", "likely cause: layers are not offloaded after their update (or not prefetched back "
                  "intact before the next one)"])


def _run_observed(ctx, cache, after_step):
    """``run_ops``' loop (prefill / chunk / decode) calling ``after_step(step)`` after every forward (probes of the
    cache's state or of GPU memory). Raises ``SubjectRaised`` on the subject's exceptions."""
    from kvconform.checks._engine import Step, encoder_ids_for, forward, seq_length

    import torch

    gen = case_generator(ctx.case, ctx.model.name)
    enc = encoder_ids_for(ctx, gen)
    seq = torch.empty(ctx.case.batch, 0, dtype=torch.long)
    steps = []
    for i, op in enumerate(ctx.case.ops):
        sizes = [op.n] if op.name in ("prefill", "chunk") else [1] * op.n if op.name == "decode" else None
        if sizes is None:
            raise ValueError(f"op {op.name!r} is not supported by {ctx.check_name}")
        for s, n in enumerate(sizes):
            label = f"decode {s + 1}" if op.name == "decode" else op.label
            new = random_tokens(gen, ctx.case.batch, n, ctx.model.vocab_size)
            try:
                logits = forward(ctx.model, cache, new, seq.shape[1], ctx.case.position_ids, enc)
            except Exception as exc:  # noqa: BLE001 - the subject's failure
                raise SubjectRaised(label, exc) from exc
            seq = torch.cat([seq, new], dim=1)
            steps.append(Step(len(steps), i, label, seq.shape[1] - n, n, logits, seq.clone(), seq_length(cache)))
            after_step(steps[-1])
    ctx.encoder_ids = enc
    return steps


check_offloaded_matches.kvconform_applies = _offloaded_row


# ------------------------------------------------------------------------------------------ mamba-ssm kernels (CUDA)
MAMBA_REASON = "mamba-ssm kernels need CUDA and the [mamba] extra (pip install kvconform[mamba])"


def _kernels_available(device) -> bool:
    import torch

    return (str(device).startswith("cuda") and torch.cuda.is_available()
            and importlib.util.find_spec("mamba_ssm") is not None
            and importlib.util.find_spec("causal_conv1d") is not None)


def _mamba_row(subject, model, case, device="cpu"):
    return None if _kernels_available(device) else MAMBA_REASON


def _dispatchers(module) -> dict:
    """``{name: (function, torch fallback, uses a kernel)}`` of the kernel-dispatching functions of a modeling
    module (``use_kernel_func_from_hub_with_fallback``: the kernel was bound at import when its package imported)."""
    out = {}
    for name, fn in vars(module).items():
        if not inspect.isfunction(fn) or fn.__module__ != module.__name__:
            continue
        fallback = inspect.unwrap(fn)
        if fallback is fn:
            continue
        uses_kernel = False
        f = fn
        while f is not None:
            free = inspect.getclosurevars(f).nonlocals if f.__closure__ else {}
            if "is_new_implementation" in free:
                uses_kernel = bool(free["is_new_implementation"])
                break
            f = getattr(f, "__wrapped__", None)
        out[name] = (fn, fallback, uses_kernel)
    return out


@contextlib.contextmanager
def _torch_path(module, dispatchers):
    """Temporarily rebind the module's kernel dispatchers to transformers' torch fallbacks."""
    saved = {name: fn for name, (fn, _, _) in dispatchers.items()}
    try:
        for name, (_, fallback, _) in dispatchers.items():
            setattr(module, name, fallback)
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


@register("logits", needs=("forward",))
def check_mamba_kernel_paths(ctx):
    """Mamba / Mamba2 on CUDA with mamba-ssm and causal-conv1d installed: the run through the kernels and the run
    through transformers' torch fallbacks (same cache subject, same ops) both match the oracle."""
    module = sys.modules[type(ctx.model.model).__module__]
    dispatchers = _dispatchers(module)
    kernels = sorted(name for name, (_, _, uses) in dispatchers.items() if uses)
    ctx.metrics.update(kernels=kernels)
    if not kernels:
        ctx.fail([f"{module.__name__} bound no mamba-ssm / causal-conv1d kernel although both import",
                  "likely cause: transformers could not import the kernels it expects from these packages "
                  "(version mismatch); the torch fallback is all that runs"])
    for label, patch in (("kernels", contextlib.nullcontext()), ("torch fallback", _torch_path(module, dispatchers))):
        with patch:
            try:
                steps = run_ops(ctx, ctx.new_cache())
            except SubjectRaised as exc:
                ctx.fail([f"the {label} path raised {describe_raise(exc)}", f"ops: {ctx.case.ops_label()}",
                          f"likely cause: the cache does not give the {label} path the states it expects"])
        verdict = judge(ctx, steps)
        _, cmp = verdict.first_fail or verdict.worst
        ctx.metrics[f"max_abs_{label.split()[0]}"] = cmp.max_abs
        if not verdict.passed:
            step, bad = verdict.first_fail
            ctx.fail([f"{label} path: max|Δlogit| = {bad.max_abs:.1e} at {step.label}, but should be ≤ "
                      f"{bad.tol:.1e} ({ctx.tolerance().describe(bad.floor)})",
                      f"ops: {ctx.case.ops_label()}; kernels: {', '.join(kernels)}",
                      f"likely cause: the {label} path reads or writes the conv / recurrent state differently "
                      "from what the cache holds"])


check_mamba_kernel_paths.kvconform_applies = _mamba_row
