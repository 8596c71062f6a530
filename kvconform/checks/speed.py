"""Family ``speed``: a cache must be fast where it says it is — budgets measured as ratios, side by side.

Every check times *targets* in interleaved rounds (``kvconform.timing.measure_interleaved``: each round runs every
target once, in rotated order; medians of ``repeats`` ≥ 5 rounds after ``warmup`` rounds; one torch thread on CPU;
``torch.cuda.synchronize`` around each target on CUDA; through pytest-benchmark's ``pedantic`` when the suite has
it). On CPU with one thread the clock is the process's CPU time, so the time a process waits for a core on a shared
machine is in no round (``kvconform.timing.clock_for``); on CUDA it is the wall clock. A target is "prefill
``context`` tokens (untimed setup), then ``steps`` single-token decode steps (timed)", reported per token. Budgets
are ratios of targets measured in the same rounds, so the machine's speed cancels out; they are declared in the case
files (``params``) and deliberately generous: a budget catches a cache doing O(context) work per token, not a 10 %
regression (use ``--benchmark-autosave``/``--benchmark-compare-fail`` for that).

* ``check_speed_vs_uncached`` — at context ≥ 512, decoding with the cache is ≥ ``min_speedup`` × faster per token
  than the uncached forward of the whole sequence (what a cache is for); a quantized cache (its layers declare
  ``nbits``/``fp8_dtype``) is held to ``min_speedup_quantized``: it dequantizes its history at every step.
* ``check_speed_flat_decode`` — per-token decode cost grows ≤ ``max_growth`` × from context ``short`` to ``long``
  (128 → 1024); the uncached forward, timed in the same rounds, shows the linear growth a cache must avoid.
* ``check_speed_prefill`` — a cached prefill of ``context`` tokens into a fresh cache takes ≤ ``max_ratio`` × the
  uncached forward of the same tokens (a cache adds one copy of its keys/values per layer to a forward that
  computes them anyway; a prefill done token by token in Python costs O(N) interpreter steps per layer, which the
  decode budgets never see); a quantized cache (``_quantized``) is held to ``max_ratio_quantized``: it quantizes
  the whole prefill.
* ``check_speed_compiled_static`` — a cache declaring ``is_compileable`` decoded through ``torch.compile`` is
  ≥ ``min_speedup`` × the speed of ``DynamicCache`` decoding eagerly (what static shapes are for); on CUDA with
  ``mode="reduce-overhead"``.

**Confirmation.** A budget exceeded in the first measurement (medians, through pytest-benchmark) is measured again
before the item fails: a second plain run of the same targets with twice the rounds, judged on each target's best
round (interference from other processes only ever adds time, so the best round is the least disturbed one). The
item fails only when the budget is exceeded in both, and its message reports both; a load spike that hit the first
measurement passes on the second (``metrics["confirmation"]`` records it). A cache that really does O(context) work
per step is slow in every round, so it fails both.

**On CUDA** (``cuda_speed_problem``, each check's ``applies`` rule): the budgets above were calibrated on a CPU,
where a tiny model's cached step is far cheaper than its uncached forward. On a GPU both are bound by kernel
launches (a cached step of the zoo's llama launches about as many kernels as the uncached forward of 513 tokens),
so a CPU-calibrated ratio would judge the launches. A case without ``params.device = "cuda"`` is judged on CUDA only
where the model's bandwidth floor (its weights' bytes at the case dtype over the GPU's memory bandwidth,
``timing.device_bandwidth``) is at least its launch floor (``timing.launch_floor_s``); elsewhere it skips with both
numbers, and the GPU's speed budgets are ``kvconform-gpu-bench``'s (measured / floor ratios on a 1.1B model).

**Positions.** Each check declares the tokens its timings reach (``tokens_held``: ``context + steps``, ``long +
steps``, the prefill's ``context``); the plan skips an item whose model takes fewer positions
(``plan.positions_problem``, from the model's config), so no forward ever runs past a learned position table.

Runtime skips (never passes): benchmarking disabled (``--benchmark-disable``). Under xdist (kvconform's default)
pytest-benchmark disables itself, so the plugin passes no fixture and the rounds run in a plain loop; the
confirmation keeps the other worker's load from flipping a verdict. Decoder-only models (cases
``requires = ["decoder_only"]``).
"""

from __future__ import annotations

from kvconform.checks import ALL_KINDS, IGNORES_OPS, Param, register
from kvconform.checks._diagnosis import fail_raised
from kvconform.checks._drive import (FIRST_TOKEN, SubjectRaised, case_generator, forward_kwargs, image_prompt,
                                     subject_call)
from kvconform.memo import MEMO
from kvconform.outcomes import breadcrumb
from kvconform.timing import Target, clock_for, measure_interleaved

DEFAULTS = {"context": 512, "short": 128, "long": 1024, "steps": 4, "uncached_steps": 1, "repeats": 5, "warmup": 1,
            "threads": 1}
"""Case ``params`` defaults. ``steps``: timed decode steps per round (cached targets); ``uncached_steps``: uncached
forwards per round (each costs a whole prefill, and varies little); ``threads``: torch threads on CPU (0: keep)."""


TIMING_PARAMS = {
    "steps": Param(int, default=DEFAULTS["steps"], min=1, doc="timed decode steps per round"),
    "repeats": Param(int, default=DEFAULTS["repeats"], min=5, doc="measured rounds (medians)"),
    "warmup": Param(int, default=DEFAULTS["warmup"], min=0, doc="untimed rounds first"),
    "threads": Param(int, default=DEFAULTS["threads"], min=0, doc="torch threads on CPU (0: keep)"),
}
CONTEXT = Param(int, default=DEFAULTS["context"], min=1, doc="tokens prefilled before the timed decode")
UNCACHED_STEPS = Param(int, default=DEFAULTS["uncached_steps"], min=1, doc="uncached forwards per round")
MIN_SPEEDUP = Param(float, required=True, min=0, doc="budget: speedup at least")
COMPILE_MODE = Param(str, choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                     doc="torch.compile mode (absent: None)")
ADAPTER_FULL_TIER = ("a model written from scratch keeps its default tier to 15 s wall on 2 cores; each of these "
                     "speed items took 4.4 s on the worked example")
"""Why the prefill and flat-decode timings run on a model adapter in the full tier only (``adapter_full_tier``);
``check_speed_vs_uncached``, the cached-vs-uncached claim, stays in its default tier."""

CUDA_DEVICE = Param(str, choices=("cpu", "cuda"), doc="cuda: the case skips off CUDA (CUDA graphs)")


def _min_context_case(case):
    """Load-time rule of ``check_speed_vs_uncached`` (``register(validate=...)``): ``params.context`` ≥ 512."""
    context = case.params.context
    if context < 512:
        return "params.context", (f"check_speed_vs_uncached needs context ≥ 512 (below, the uncached forward is too "
                                  f"cheap to tell a cache apart); got {context}")
    return None


def _growth_case(case):
    """Load-time rule of ``check_speed_flat_decode``: ``params.long`` ≥ 4 × ``params.short``."""
    short, long = case.params.short, case.params.long
    if long < 4 * short:
        return "params.long", (f"check_speed_flat_decode needs long ≥ 4 × short to see growth; got short = {short}, "
                               f"long = {long}: raise long to ≥ {4 * short} or lower short")
    return None


_SIZES: dict = MEMO.table("speed.model_sizes")


def _model_size(model) -> tuple[int, int] | None:
    """``(parameters, decoder layers)`` of ``model`` (a ``plan.ModelInfo``) from its config, built on the meta device
    (no weights; memoised per spec), or None where it does not build there (a model written from scratch)."""
    if model.spec not in _SIZES:
        try:
            from kvconform.subjects.construction import meta_model

            config = model.model_config()  # its source reads it
            meta = meta_model(config)
            text = config.get_text_config(decoder=True)
            layers = int(getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None) or 1)
            _SIZES[model.spec] = (sum(p.numel() for p in meta.parameters()), layers)
        except Exception:  # noqa: BLE001 - a from-scratch model, a config that does not build on meta
            _SIZES[model.spec] = None
    return _SIZES[model.spec]


def cuda_speed_problem(model, case, device) -> str | None:
    """The applicability rule of the speed family on CUDA (``register(applies=...)``): a budget written for the CPU
    (every case without ``params.device = "cuda"``) is judged on CUDA only where the model is big enough that a
    decode step is bound by reading its weights, not by launching its kernels: the bandwidth floor (weights bytes
    at the case dtype over the device's memory bandwidth, ``timing.device_bandwidth``; the fastest GPU's when
    planned without one) at least the launch floor (``timing.launch_floor_s``). The zoo's tiny models are
    launch-bound on every GPU (a cached step launches about as many kernels as the uncached forward of 513
    tokens), so their items skip with the numbers; the GPU's speed budgets are ``kvconform-gpu-bench``'s
    (measured/floor ratios on a 1.1B model). None elsewhere."""
    from kvconform.compat import on_cuda

    if case.params.get("device") == "cuda" or not on_cuda(device):
        return None
    import torch

    from kvconform.timing import decode_floor_s, device_bandwidth, launch_floor_s

    size = _model_size(model)
    gpu = torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else None
    bandwidth, source = device_bandwidth(gpu)
    if size is None:
        return (f"on CUDA the speed budgets of case {case.id} (calibrated on CPU) are judged only on a model whose "
                f"size kvconform can read from its config ({model.name}'s is not): the GPU's speed budgets are "
                f"kvconform-gpu-bench's")
    params, layers = size
    weights = params * getattr(torch, case.dtype).itemsize
    floor, launch = decode_floor_s(weights, bandwidth), launch_floor_s(layers)
    if floor >= launch:
        return None
    return (f"on CUDA {model.name} is launch-bound: a decode step reads {weights / 1e6:.2g} MB of weights, "
            f"{floor * 1e6:.2g} µs at {bandwidth / 1e12:.3g} TB/s ({source}), under the ~{launch * 1e6:.0f} µs of "
            f"launching {layers} layers' kernels, so the CPU-calibrated budget of case {case.id} would time "
            f"launches; the GPU's speed budgets are kvconform-gpu-bench's (measured/floor ratios on a 1.1B model)")


def _cuda_rule(subject, model, case, device="cpu"):
    """``register(applies=...)`` of the speed checks without a rule of their own: ``cuda_speed_problem``."""
    return cuda_speed_problem(model, case, device)


def _held_context_steps(case) -> int:
    """``@register(tokens_held=...)`` of the decode timings: ``context + steps`` tokens (the plan's position rule,
    ``plan.positions_problem``, reads it: a model with fewer positions skips the item instead of raising)."""
    return case.params.context + case.params.steps


def _held_long_steps(case) -> int:
    """``tokens_held`` of ``check_speed_flat_decode``: ``long + steps``."""
    return case.params.long + case.params.steps


def _held_prefill(case) -> int:
    """``tokens_held`` of ``check_speed_prefill``: ``context`` (one prefill)."""
    return case.params.context


def _tokens(ctx, length):
    import torch

    gen = case_generator(ctx.case, ctx.model.name)
    return image_prompt(ctx.model, torch.randint(FIRST_TOKEN, ctx.model.vocab_size, (ctx.case.batch, length),
                                                 generator=gen))


def _both_rounds(first, second, name: str, other: str, other_label: str, timer_note: str = "") -> list[str]:
    """The lines of a confirmed speed failure that give both measurements (``_confirm``'s ``first`` and ``second``):
    ``name``'s timings against ``other``'s (``other_label`` in the text) in the first rounds, its timer line (plus
    ``timer_note``), then the same for the confirmation rounds."""
    (timings, timer, *_), (timings2, timer2, *_) = first, second
    return [f"first: {name}: {timings[name].describe()}; {other_label}: {timings[other].describe()}",
            timer + timer_note,
            f"confirmation: {name}: {timings2[name].describe()}; {other_label}: {timings2[other].describe()}",
            timer2]


def cached_target(ctx, name, spec, tokens, context, steps, forward=None) -> Target:
    """Setup: a fresh cache of ``spec`` sized ``context + steps``, prefilled with ``tokens[:, :context]``
    (untimed). Run: ``steps`` single-token decode steps through ``forward`` (default: the eager model)."""
    import torch

    m = ctx.model.model
    fwd = forward or m

    def setup():
        breadcrumb(f"{name}: prefill({context}) of a speed target")
        cache = spec.build(ctx.model, max_cache_len=context + steps, batch_size=ctx.case.batch)
        try:
            with torch.no_grad(), subject_call(cache, m):
                m(**forward_kwargs(m, cache, tokens[:, :context], 0))
        except Exception as exc:  # noqa: BLE001 - the subject's failure, reported on its item
            raise SubjectRaised(f"{name}: prefill({context})", exc) from exc
        return cache

    def run(cache):
        breadcrumb(f"{name}: {steps} timed decode steps from position {context}")
        with torch.no_grad():
            for s in range(steps):
                pos = context + s
                try:
                    with subject_call(cache, m):  # a (cache, context) subject's context: part of its cost
                        fwd(**forward_kwargs(m, cache, tokens[:, pos:pos + 1], pos))
                except Exception as exc:  # noqa: BLE001 - the subject's failure, reported on its item
                    raise SubjectRaised(f"{name}: decode at position {pos}", exc) from exc

    return Target(name, run, setup, units=steps)


def uncached_target(ctx, name, tokens, context, steps) -> Target:
    """Run: ``steps`` uncached forwards of the whole sequence ``tokens[:, :context + s + 1]`` (what decoding without
    a cache costs per token)."""
    import torch

    m = ctx.model.model

    def run(_):
        with torch.no_grad():
            for s in range(steps):
                m(**forward_kwargs(m, None, tokens[:, :context + s + 1], 0))

    return Target(name, run, units=steps)


def _measure(ctx, targets, extra, confirm=False):
    """Time ``targets`` (``measure_interleaved``) with the case's rounds; ``confirm``: the confirmation measurement
    (twice the rounds, a plain loop: pytest-benchmark's fixture times one call per item). Returns
    ``(timings, timer_text)``."""
    device = next(ctx.model.model.parameters()).device
    threads = ctx.case.params.threads if device.type == "cpu" else None
    repeats = ctx.case.params.repeats * (2 if confirm else 1)
    try:
        timings = measure_interleaved(targets, repeats=repeats,
                                      warmup=ctx.case.params.warmup, device=device,
                                      benchmark=None if confirm else ctx.benchmark,
                                      threads=threads, extra_info={"subject": ctx.subject.name,
                                                                   "model": ctx.model.name, "case": ctx.case.id,
                                                                   **extra})
    except SubjectRaised as exc:  # the short message every family gives, not a benchmark-loop traceback
        contexts = ", ".join(str(extra[k]) for k in ("context", "short", "long") if k in extra)
        fail_raised(ctx, exc, "the cache fails on the long contexts the speed family measures (the other "
                              "families' cases are short)",
                    ops_text=f"prefill({extra['prefill']}) timed" if "prefill" in extra else
                    f"prefill(context {contexts}, untimed) → decode×{ctx.case.params.steps} timed")
    ctx.measured.record(timed_steps=min((len(t.seconds) for t in timings.values()), default=0))
    clock = clock_for(device, threads).name
    timer = (f"timer: {clock}{' + cuda.synchronize' if device.type == 'cuda' else ''} on {device.type}"
             f"{f', {threads} thread' if threads else ''}; "
             + (f"confirmation: best of {repeats} interleaved rounds" if confirm else
                f"medians of {repeats} interleaved rounds"
                f"{' (pytest-benchmark pedantic)' if ctx.benchmark is not None else ''}"))
    return timings, timer


def _median(timing) -> float:
    return timing.median


def _best(timing) -> float:
    return timing.minimum


def _confirm(ctx, targets, extra, judge):
    """The verdict of a speed item, confirmed (see the module docstring).

    ``judge(timings, stat) -> (value, exceeded)``: the item's ratio computed with ``stat`` (``_median`` or ``_best``,
    seconds per unit of a ``Timing``) and whether it exceeds the budget. Returns ``(first, second)``, each
    ``(timings, timer, value, exceeded)``; ``second`` is None when the first measurement kept the budget. The item
    fails only when both exceeded."""
    timings, timer = _measure(ctx, targets, extra)
    value, exceeded = judge(timings, _median)
    first = (timings, timer, value, exceeded)
    if not exceeded:
        return first, None
    timings2, timer2 = _measure(ctx, targets, extra, confirm=True)
    value2, exceeded2 = judge(timings2, _best)
    ctx.metrics.update(confirmation=round(value2, 3), confirmation_exceeded=exceeded2)
    return first, (timings2, timer2, value2, exceeded2)


def _quantized(ctx) -> bool:
    """Whether the subject is declared lossy or its cache layers declare quantization (``nbits`` / ``fp8_dtype``, as
    the memory family reads them): such a cache dequantizes its whole history at every step (and re-quantizes it every
    ``residual_length`` steps), so its budget against the uncached forward is ``params.min_speedup_quantized``."""
    from kvconform.checks._measure import cache_layers, quant_params

    if ctx.kind.declared_lossy:  # declared lossy (kvconform_lossy / CacheSpec.kind)
        return True
    try:
        cache = ctx.new_cache()
    except Exception:  # noqa: BLE001 - the measurement will report the failure
        return False
    return any(quant_params(layer) is not None for _, layer in cache_layers(cache))


def _ms(t, stat=None) -> str:
    return f"{(stat or _median)(t) * 1e3:.2f}"


@register("speed", cost=6.0, timed=True, needs=("forward",), judges=ALL_KINDS, applies=_cuda_rule, params={
    **TIMING_PARAMS, "context": CONTEXT, "uncached_steps": UNCACHED_STEPS, "min_speedup": MIN_SPEEDUP,
    "min_speedup_quantized": Param(float, min=0, doc="budget of a quantized subject (default: min_speedup)"),
}, ops=IGNORES_OPS, validate=_min_context_case, tokens_held=_held_context_steps)
def check_speed_vs_uncached(ctx):
    """At context ≥ 512, cached decode beats the uncached forward per token by ``params.min_speedup``."""
    context, steps = ctx.case.params.context, ctx.case.params.steps
    floor, quantized = ctx.case.params.min_speedup, _quantized(ctx)
    if quantized:
        floor = floor if ctx.case.params.min_speedup_quantized is None else ctx.case.params.min_speedup_quantized
    if context < 512:
        raise ValueError(f"case {ctx.case.id}: check_speed_vs_uncached needs context ≥ 512, got {context}")
    usteps = ctx.case.params.uncached_steps
    tokens = _tokens(ctx, context + steps)
    subject = ctx.subject.name
    targets = [cached_target(ctx, subject, ctx.subject, tokens, context, steps),
               uncached_target(ctx, "uncached", tokens, context, usteps)]

    def judge(timings, stat):
        speedup = stat(timings["uncached"]) / stat(timings[subject])
        return speedup, speedup < floor

    first, second = _confirm(ctx, targets, {"context": context, "min_speedup": floor}, judge)
    timings, _, speedup, _ = first
    cached, uncached = timings[subject], timings["uncached"]
    ctx.metrics.update(speedup=round(speedup, 2), min_speedup=floor, context=context, quantized=quantized,
                       ms_per_token=round(cached.median * 1e3, 3),
                       uncached_ms_per_token=round(uncached.median * 1e3, 3))
    if second is not None and second[3]:
        speedup2 = second[2]
        ctx.fail([
            f"cached decode is {speedup:.2f}× as fast as the uncached forward at context {context} "
            f"(confirmed: {speedup2:.2f}× in a second measurement), but should be ≥ {floor:g}×"
            + (" (the budget of a quantized cache, which dequantizes every step)" if quantized else ""),
            *_both_rounds(first, second, subject, "uncached", "uncached"),
            f"ops: prefill({context}, untimed) → decode×{steps} timed, batch {ctx.case.batch}",
            "likely cause: each decode step costs as much as re-running the context: the cache rebuilds or copies "
            "its keys/values token by token (O(context) work per step), or recomputes what it should keep",
        ], {"speedup": speedup, "confirmation": speedup2})


@register("speed", cost=6.0, timed=True, needs=("forward",), judges=ALL_KINDS, applies=_cuda_rule, params={
    **TIMING_PARAMS, "uncached_steps": UNCACHED_STEPS,
    "short": Param(int, default=DEFAULTS["short"], min=1, doc="the short context"),
    "long": Param(int, default=DEFAULTS["long"], min=1, doc="the long context"),
    "max_growth": Param(float, required=True, min=0, doc="budget: per-token cost at long / at short"),
    "max_growth_quantized_share": Param(float, default=1.0, min=0, max=2,
                                        doc="budget of a quantized subject: its growth ≤ this share of the uncached "
                                            "forward's growth in the same rounds (and always ≤ max_growth is "
                                            "enough)"),
}, ops=IGNORES_OPS, validate=_growth_case, tokens_held=_held_long_steps, adapter_full_tier=ADAPTER_FULL_TIER)
def check_speed_flat_decode(ctx):
    """Per-token decode cost grows ≤ ``params.max_growth`` × from context ``short`` to ``long``; the uncached
    forward, in the same rounds, grows ~linearly. A quantized subject (``_quantized``) dequantizes its history at
    every step, so it is held to ``max_growth_quantized_share`` × the uncached growth instead when that is larger:
    it must not grow faster than recomputing the context."""
    short, long, steps = ctx.case.params.short, ctx.case.params.long, ctx.case.params.steps
    ceiling = ctx.case.params.max_growth
    usteps = ctx.case.params.uncached_steps
    if long < 4 * short:
        raise ValueError(f"case {ctx.case.id}: long ({long}) should be ≥ 4 × short ({short}) to see growth")
    tokens = _tokens(ctx, long + steps)
    subject = ctx.subject.name
    targets = [cached_target(ctx, f"{subject}@{short}", ctx.subject, tokens, short, steps),
               cached_target(ctx, f"{subject}@{long}", ctx.subject, tokens, long, steps),
               uncached_target(ctx, f"uncached@{short}", tokens, short, usteps),
               uncached_target(ctx, f"uncached@{long}", tokens, long, usteps)]
    quantized, share = _quantized(ctx), ctx.case.params.max_growth_quantized_share

    def budget(ugrowth):
        # A quantized cache dequantizes its whole history at every decode step (transformers' QuantizedCache does,
        # by design) and re-quantizes all of it every residual_length steps: its per-token cost is O(context). On
        # the 2-core CPU, 128 → 1024 tokens, under xdist: quanto, fp8 0.6-2.5×; HQQ 2.4-6.0× (its iterative
        # optimiser, with early stopping, runs over the whole history at each re-quantization) against the
        # uncached forward's 3.9-12× in the same rounds (HQQ/uncached 0.6-1.06). It must not grow faster than
        # recomputing the context; a quantized cache doing per-token Python work is caught by speed_vs_uncached.
        return max(ceiling, share * ugrowth) if quantized else ceiling

    def judge(timings, stat):
        growth = stat(timings[f"{subject}@{long}"]) / stat(timings[f"{subject}@{short}"])
        ugrowth = stat(timings[f"uncached@{long}"]) / stat(timings[f"uncached@{short}"])
        return growth, growth > budget(ugrowth)

    first, second = _confirm(ctx, targets, {"short": short, "long": long, "max_growth": ceiling}, judge)
    timings, timer, growth, _ = first
    a, b = timings[f"{subject}@{short}"], timings[f"{subject}@{long}"]
    ua, ub = timings[f"uncached@{short}"], timings[f"uncached@{long}"]
    ugrowth = ub.median / ua.median
    limit = budget(ugrowth)
    ctx.metrics.update(growth=round(growth, 2), max_growth=round(limit, 3), uncached_growth=round(ugrowth, 2),
                       ms_per_token_short=round(a.median * 1e3, 3), ms_per_token_long=round(b.median * 1e3, 3),
                       short=short, long=long, quantized=quantized)
    if second is not None and second[3]:
        timings2, timer2, growth2, _ = second
        a2, b2 = timings2[f"{subject}@{short}"], timings2[f"{subject}@{long}"]
        ua2, ub2 = timings2[f"uncached@{short}"], timings2[f"uncached@{long}"]
        ugrowth2 = ub2.minimum / ua2.minimum
        limit2 = budget(ugrowth2)

        def budget_text(limit, ugrowth):
            if not quantized:
                return f"{ceiling:g}×"
            return (f"{limit:.2f}× (a quantized cache dequantizes its history every step: ≤ {share:g} × the "
                    f"uncached growth {ugrowth:.2f}×, or ≤ max_growth)")

        ctx.fail([
            f"per-token decode cost grew {growth:.2f}× from context {short} to {long}, but should grow "
            f"≤ {budget_text(limit, ugrowth)}",
            f"confirmed by a second measurement: grew {growth2:.2f}×, budget {budget_text(limit2, ugrowth2)}",
            f"first: {subject}: {_ms(a)} → {_ms(b)} ms/token (medians); uncached forward in the same rounds: "
            f"{_ms(ua)} → {_ms(ub)} ms/token ({ugrowth:.2f}×)",
            timer,
            f"confirmation: {subject}: {_ms(a2, _best)} → {_ms(b2, _best)} ms/token (best rounds); uncached forward: "
            f"{_ms(ua2, _best)} → {_ms(ub2, _best)} ms/token ({ugrowth2:.2f}×)",
            timer2,
            f"ops: prefill({short} | {long}, untimed) → decode×{steps} timed, batch {ctx.case.batch}",
            "likely cause: every decode step does work proportional to the context in Python — a loop over "
            "tokens or chunks, a rebuild from a list — instead of one append (or one in-place write)",
        ], {"growth": growth, "uncached_growth": ugrowth, "confirmation": growth2})


def prefill_target(ctx, name, spec, tokens, context) -> Target:
    """Setup: a fresh, empty cache of ``spec`` sized ``context + 1`` (untimed). Run: one forward of
    ``tokens[:, :context]`` into it (the prefill, timed). ``spec`` None: the uncached forward of the same tokens
    (``use_cache=False``; no setup). Times per token of the prefill (``units = context``)."""
    import torch

    m = ctx.model.model

    def setup():
        return spec.build(ctx.model, max_cache_len=context + 1, batch_size=ctx.case.batch)

    def run(cache):
        breadcrumb(f"{name}: timed prefill({context})")
        with torch.no_grad():
            if spec is None:
                m(**forward_kwargs(m, None, tokens[:, :context], 0))
                return
            try:
                with subject_call(cache, m):
                    m(**forward_kwargs(m, cache, tokens[:, :context], 0))
            except Exception as exc:  # noqa: BLE001 - the subject's failure, reported on its item
                raise SubjectRaised(f"{name}: prefill({context})", exc) from exc

    return Target(name, run, setup, units=context) if spec is not None else Target(name, run, units=context)


@register("speed", cost=6.0, timed=True, needs=("forward",), judges=ALL_KINDS, applies=_cuda_rule, params={
    **TIMING_PARAMS, "context": Param(int, default=1024, min=64, doc="tokens of the timed prefill"),
    "max_ratio": Param(float, required=True, min=1, doc="budget: cached prefill time / uncached forward time"),
    "max_ratio_quantized": Param(float, min=1, doc="budget of a quantized subject (default: max_ratio)"),
}, ops=IGNORES_OPS, tokens_held=_held_prefill, adapter_full_tier=ADAPTER_FULL_TIER)
def check_speed_prefill(ctx):
    """A cached prefill of ``params.context`` tokens into a fresh cache takes ≤ ``params.max_ratio`` × the uncached
    forward of the same tokens, timed side by side (medians, confirmed; ``params.steps`` is not used)."""
    context = ctx.case.params.context
    ceiling, quantized = ctx.case.params.max_ratio, _quantized(ctx)
    if quantized:
        ceiling = ctx.case.params.max_ratio_quantized or ceiling
    tokens = _tokens(ctx, context)
    subject = ctx.subject.name
    targets = [prefill_target(ctx, subject, ctx.subject, tokens, context),
               prefill_target(ctx, "uncached", None, tokens, context)]

    def judge(timings, stat):
        ratio = stat(timings[subject]) / stat(timings["uncached"])
        return ratio, ratio > ceiling

    first, second = _confirm(ctx, targets, {"prefill": context, "max_ratio": ceiling}, judge)
    timings, _, ratio, _ = first
    cached, uncached = timings[subject], timings["uncached"]
    ctx.metrics.update(prefill_ratio=round(ratio, 2), max_ratio=ceiling, context=context, quantized=quantized,
                       ms_per_prefill=round(cached.median * context * 1e3, 3),
                       uncached_ms_per_forward=round(uncached.median * context * 1e3, 3))
    if second is not None and second[3]:
        ratio2 = second[2]
        ctx.fail([
            f"a cached prefill of {context} tokens took {ratio:.2f}× the uncached forward of the same tokens "
            f"(confirmed: {ratio2:.2f}× in a second measurement), but should take ≤ {ceiling:g}×"
            + (" (the budget of a quantized cache, which quantizes the whole prefill)" if quantized else ""),
            *_both_rounds(first, second, subject, "uncached", "uncached"),
            f"ops: prefill({context}) into a fresh cache, timed; the uncached forward of the same {context} tokens "
            f"in the same rounds; batch {ctx.case.batch}",
            "likely cause: " + _prefill_loop_cause(ctx, tokens, context),
        ], {"prefill_ratio": ratio, "confirmation": ratio2})


def _prefill_loop_cause(ctx, tokens, context: int) -> str:
    """Why a cached prefill is slow, from what one untimed prefill of ``context`` tokens leaves in the first
    attention layer: many tensors, each holding a few tokens, is a paged layout (then the Python loop is over its
    pages, once per page of P tokens, not per token); one tensor per token is a per-token loop; else a general
    per-token reading."""
    import torch

    from kvconform.checks._measure import cache_layers, held_tensor_items

    generic = ("the prefill does work per token in Python — update() loops over the new tokens (a per-token copy, "
               "append or bookkeeping step) instead of one slice copy or cat per forward; decode steps feed one token "
               "each, so the decode budgets cannot see it")
    m = ctx.model.model
    try:
        cache = ctx.subject.build(ctx.model, max_cache_len=context + 1, batch_size=ctx.case.batch)
        with torch.no_grad(), subject_call(cache, m):
            m(**forward_kwargs(m, cache, tokens[:, :context], 0))
        layers = cache_layers(cache)
        counts = [len([t for _, t in held_tensor_items(layer) if t.dim() >= 3]) for _, layer in layers[:1]]
    except Exception:  # noqa: BLE001 - no measurement: the general reading
        return generic
    if not counts or counts[0] < 8:
        return generic
    n = counts[0]
    per = context * 2 / n  # keys and values: tokens per tensor
    if per >= 1.5:
        return (f"the prefill loops in Python over the pages of its paged storage: after prefill({context}) its "
                f"first layer holds {n} tensors (about {per:.0f} tokens each), and the prefill writes them one page "
                f"at a time — one copy per page, not per token; write a prefill's pages with one batched copy "
                f"(torch._foreach_copy_, or one index_copy_ into a page pool) instead of a Python loop")
    return (f"the prefill does work per token in Python: after prefill({context}) its first layer holds {n} "
            f"tensors, one per token — a per-token copy or append instead of one slice copy or cat per forward; "
            f"decode steps feed one token each, so the decode budgets cannot see it")


def _compiled_applies(subject, model, case, device="cpu"):
    from kvconform.checks._compiled import compile_applies

    return compile_applies(True)(subject, model, case, device=device) or cuda_speed_problem(model, case, device)


@register("speed", cost=6.0, timed=True, needs=("compile",), judges=ALL_KINDS, applies=_compiled_applies, params={
    **TIMING_PARAMS, "context": CONTEXT, "min_speedup": MIN_SPEEDUP, "mode": COMPILE_MODE, "device": CUDA_DEVICE,
}, ops=IGNORES_OPS, tokens_held=_held_context_steps,
    transformers_only="the compiled StaticCache is timed against transformers' DynamicCache eager on the same model, "
                      "a cache a from-scratch model does not take")
def check_speed_compiled_static(ctx):
    """A cache declaring ``is_compileable``, decoded through ``torch.compile`` (``params.mode``), is
    ≥ ``params.min_speedup`` × as fast per token as ``DynamicCache`` decoding eagerly, side by side."""
    import torch

    from kvconform.subjects import CacheSpec, _dynamic

    context, steps = ctx.case.params.context, ctx.case.params.steps
    floor = ctx.case.params.min_speedup
    mode = ctx.case.params.get("mode")
    tokens = _tokens(ctx, context + steps)
    m = ctx.model.model
    subject = ctx.subject.name
    torch.compiler.reset()
    compiled = torch.compile(m.forward, fullgraph=True, dynamic=False, mode=mode)
    cudagraphs = mode in ("reduce-overhead", "max-autotune")

    def forward(**kwargs):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(**kwargs)

    name = f"{subject}+compile"
    dynamic = CacheSpec("DynamicCache", _dynamic)
    try:
        # the warm-up round compiles (untimed); afterwards a miss runs eagerly instead of recompiling
        warm = cached_target(ctx, name, ctx.subject, tokens, context, steps, forward)
        state = {"rounds": 0}
        base_setup = warm.setup

        def setup():
            if state["rounds"] == ctx.case.params.warmup:
                torch.compiler.set_stance("eager_on_recompile")
            state["rounds"] += 1
            return base_setup()

        warm.setup = setup

        def judge(timings, stat):
            speedup = stat(timings["DynamicCache"]) / stat(timings[name])
            return speedup, speedup < floor

        first, second = _confirm(ctx, [warm, cached_target(ctx, "DynamicCache", dynamic, tokens, context, steps)],
                                 {"context": context, "min_speedup": floor, "mode": mode}, judge)
    finally:
        torch.compiler.set_stance("default")
        torch.compiler.reset()
    timings, _, speedup, _ = first
    fast, base = timings[name], timings["DynamicCache"]
    ctx.metrics.update(speedup=round(speedup, 2), min_speedup=floor, context=context, mode=mode,
                       ms_per_token=round(fast.median * 1e3, 3), dynamic_ms_per_token=round(base.median * 1e3, 3))
    if second is not None and second[3]:
        speedup2 = second[2]
        ctx.fail([
            f"{subject} + torch.compile decodes {speedup:.2f}× as fast as DynamicCache eager at context {context} "
            f"(confirmed: {speedup2:.2f}× in a second measurement), but should be ≥ {floor:g}×",
            *_both_rounds(first, second, name, "DynamicCache", "DynamicCache eager",
                          f"; compile mode={mode!r}, fullgraph=True, dynamic=False"),
            f"ops: prefill({context}, eager, untimed) → decode×{steps} timed, batch {ctx.case.batch}",
            "likely cause: the compiled decode misses its graph (recompiles run eagerly here: see the compile "
            "family) or the static cache does work proportional to max_cache_len per step",
        ], {"speedup": speedup, "confirmation": speedup2})
