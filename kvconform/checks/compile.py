"""Family ``compile``: ``torch.compile`` conformance of the decode loop.

The protocol (``run_protocol``), the way ``generate`` and the transformers docs compile a static cache: the prefill
runs eagerly, every decode step through ``torch.compile(model.forward, fullgraph=True, dynamic=False)``. Three
sequences of the same shape and different tokens: **A** on a fresh cache, **B** on the same cache after
``reset()``, **C** on a second, fresh cache object. The first compiled call (A's first decode step) is the warm-up
that compiles; from then on ``torch.compiler.set_stance("fail_on_recompile")`` is set, so a call that misses the
compiled graph raises at once, with dynamo's guard-failure reasons, instead of compiling again: the check counts
it, keeps the reason and runs that step eagerly. Recompiles are therefore counted at no compile cost, and every
compiled step's logits are compared with the same ops run eagerly on the subject (A, reset, B, fresh C).

``check_compile_static_decode`` — subjects whose cache declares ``is_compileable = True``: no graph break
(``fullgraph=True``), **zero** recompiles after the warm-up (across steps, ``reset()`` and a fresh cache object),
compiled logits equal eager within ``max(k · noise floor, abs_min)``; with ``mode="reduce-overhead"`` on CUDA, no
cudagraph skips either. ``check_compile_claim`` — subjects declaring ``is_compileable = False``, compiled anyway the
way a user compiling the model would (``fullgraph=False``): it fails on a crash or on compiled logits that differ
from eager (a silent miscompile), and reports the claim as *confirmed* (graph breaks or recompiles, with the first
reason) or *conservative* (one graph, no recompile on this model — e.g. ``ReferenceCache`` on the all-linear Mamba:
fixed-size states). A conservative claim is not a fault: this CPU protocol does not test the static addresses CUDA
graphs need.

Why a recompile after the warm-up is a fault even though torch would "just" recompile: with ``dynamic=False`` a
Python int that changes every step recompiles every step until ``torch._dynamo.config.recompile_limit`` (8), after
which ``fullgraph=True`` raises ``FailOnRecompileLimitHit`` and ``fullgraph=False`` silently runs eagerly; with
``dynamic=None`` (generate's default) dynamo recompiles once into a graph taking the int as a SymInt input, and CUDA
graphs (``mode="reduce-overhead"``) then record a new graph for every new value, i.e. every step. The same holds for
transformers' own sliding-window ``StaticCache`` on 5.24 (``StaticSlidingWindowLayer.cumulative_length_int``):
kvconform reports it as a fault, listed in ``known_faults.toml`` (xfail unless ``--kvconform-strict``).

Applicability (decided at collection, ``@register(..., applies=...)``): the subject's cache is built for the model
(cheap,
no tensors) and its ``is_compileable`` read; ``params.device = "cuda"`` cases skip off CUDA. Compile state is
process-global: every item starts and ends with ``torch.compiler.reset()``.

Case ``params``: ``mode`` (None | "default" | "reduce-overhead" | "max-autotune"), ``backend`` ("inductor"),
``dynamic`` (false), ``device`` ("cuda" → CUDA only).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from kvconform.checks import OP_PARAMS, OpRule, Param, register
from kvconform.checks._drive import (FIRST_TOKEN, SubjectRaised, case_generator, encoder_input, forward_kwargs,
                                     image_prompt, subject_call)
from kvconform.checks._measure import layer_items, read_attr, self_half, tensors_of
from kvconform.checks._interpreter import Runner
from kvconform.checks._compiled import compile_applies, declared_compileable  # noqa: F401 - re-exported
from kvconform.checks._diagnosis import fail_raised

_RECOMPILE = "Detected recompile"
_GUARD = re.compile(r"^\s*-\s*(?:\d+/\d+:\s*)?(?P<guard>.+?)\s*(?:#\s*(?P<src>.*))?$")


# ------------------------------------------------------------------------------------------------ applicability
# (the is_compileable claim, CUDA-only cases) lives in the engine: the speed family uses it too
_applies = compile_applies


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""``torch.compile`` modes a case may name (``params.mode``; absent: ``mode=None``)."""
COMPILE_PARAMS = {
    "mode": Param(str, choices=COMPILE_MODES, doc="torch.compile mode (absent: None)"),
    "backend": Param(str, default="inductor", doc="torch.compile backend"),
    "dynamic": Param(bool, default=False, doc="torch.compile dynamic shapes"),
    "device": Param(str, choices=("cpu", "cuda"), doc="cuda: the case skips off CUDA (CUDA graphs)"),
}


ADAPTER_FULL_TIER = ("a model written from scratch keeps its default tier to 15 s wall on 2 cores; a compile item took "
                     "7.8 CPU-s on the worked example (inductor's compile)")
"""Why the compile checks run on a model adapter in the full tier only (``adapter_full_tier``);
``check_static_addresses`` (no compile) stays in its default tier."""

COMPILE_OPS = OpRule(shape=("prefill", "decode"), why="prefill P, then N compiled decode steps (N ≥ 8 recommended)")


def _protocol_case(case):
    """Load-time rule of the compile protocol (``register(validate=...)``): at least 2 decode steps."""
    if len(case.ops) == 2 and case.ops[1].n < 2:
        return "ops", (f"the compile checks need ops = ['prefill P', 'decode N'] with N ≥ 2 (8 recommended: the "
                       f"warm-up and the recompile count need steps); got 'decode {case.ops[1].n}'")
    return None


# ------------------------------------------------------------------------------------------------ the protocol
@dataclass
class Recompile:
    """One compiled call that missed the graph: ``where`` (``"A step 2"``), the failing ``guard`` expression and the
    ``source`` line dynamo names for it."""

    where: str
    guard: str
    source: str


@dataclass
class ProtocolRun:
    """What ``run_protocol`` observed. Logits are float64 ``[B, 1, V]`` per decode step, keyed by ``(seq, step)``."""

    compile_seconds: float = 0.0
    graph_break: str | None = None
    graph_break_where: str = ""
    error: str | None = None
    recompiles: list = field(default_factory=list)
    compiled_calls: int = 0
    eager_fallbacks: int = 0
    graph_breaks_counted: int = 0
    graphs: int = 0
    compiled: dict = field(default_factory=dict)
    eager: dict = field(default_factory=dict)
    sequences: dict = field(default_factory=dict)
    cudagraph_skips: int = 0


def _protocol_shape(case):
    ops = case.ops
    if len(ops) != 2 or ops[0].name != "prefill" or ops[1].name != "decode" or ops[1].n < 2:
        raise ValueError(f"case {case.id}: the compile checks need ops = ['prefill P', 'decode N'] (N ≥ 8 "
                         f"recommended), got {[op.label for op in ops]}")
    return ops[0].n, ops[1].n


def _sequences(ctx):
    """Tokens of sequences A, B, C: ``{name: (encoder_ids or None, tokens [B, P+N])}``, distinct per sequence. A
    VLM's prefill starts with its image (``image_prompt``: the eager prefill gets the pixels; the compiled decode
    steps attend to the image's keys/values in the cache)."""
    import torch

    prefill, steps = _protocol_shape(ctx.case)
    gen = case_generator(ctx.case, ctx.model.name)
    out = {}
    for name in ("A", "B", "C"):
        enc = (encoder_input(ctx.model, gen, ctx.case.batch, ctx.case.encoder_len)
               if ctx.model.is_encoder_decoder else None)
        tokens = torch.randint(FIRST_TOKEN, ctx.model.vocab_size, (ctx.case.batch, prefill + steps), generator=gen)
        tokens[:, :prefill] = image_prompt(ctx.model, tokens[:, :prefill])  # unchanged without an image prefix
        out[name] = (enc, tokens)
    return out


def _kwargs(ctx, cache, tokens, start, enc):
    return forward_kwargs(ctx.model.model, cache, tokens, start, enc if ctx.model.is_encoder_decoder else None)


def _logits(out):
    import torch

    return out.logits[:, -1:].detach().to("cpu", torch.float64)


def _drive(ctx, seqs, step_fn):
    """A, reset, B, fresh C: prefill eagerly, then ``step_fn(sequence, step, kwargs)`` per decode step."""
    import torch

    prefill, steps = _protocol_shape(ctx.case)
    m = ctx.model.model
    cache: Any = None
    for name, (enc, tokens) in seqs.items():
        if name == "A" or name == "C":
            cache = ctx.new_cache()
        else:
            cache.reset()
        with torch.no_grad():
            with subject_call(cache, m):
                m(**_kwargs(ctx, cache, tokens[:, :prefill], 0, enc))
            for s in range(steps):
                pos = prefill + s
                with subject_call(cache, m):  # a (cache, context) subject: its context around each call
                    step_fn(name, s, _kwargs(ctx, cache, tokens[:, pos:pos + 1], pos, enc))


def _first_guard(message: str) -> tuple[str, str]:
    """``(guard expression, source)`` of the first guard failure in a ``fail_on_recompile`` message."""
    lines = message.splitlines()
    for i, line in enumerate(lines):
        if "guard failure" in line and i + 1 < len(lines):
            match = _GUARD.match(lines[i + 1])
            if match:
                return match.group("guard").strip(), (match.group("src") or "").strip()
    return message.splitlines()[0][:200], ""


def _user_frame(message: str) -> str:
    """The innermost ``File ..., line N, in fn`` of dynamo's "from user code" section, shortened."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', message)
    if not frames:
        return ""
    path, line, fn = frames[-1]
    return f"{path.rsplit('/', 2)[-2] + '/' + path.rsplit('/', 1)[-1] if '/' in path else path}:{line} in {fn}"


def _record_compile_failure(run: ProtocolRun, exc: Exception) -> None:
    """Record on ``run`` why the first compiled call raised ``exc``: a graph break (dynamo's ``Unsupported`` or
    ``UserError``, or a message naming one: its first line, at most 240 characters, and the user frame it names) or
    else a compile error (``"ExcType: first line"``)."""
    text = str(exc)
    if type(exc).__name__ in ("Unsupported", "UserError") or "graph break" in text.lower():
        run.graph_break = text.strip().splitlines()[0][:240]
        run.graph_break_where = _user_frame(text)
    else:
        run.error = f"{type(exc).__name__}: {text.strip().splitlines()[0][:240] if text.strip() else ''}"


def run_protocol(ctx, fullgraph: bool = True) -> ProtocolRun:
    """Run A / reset B / fresh C eagerly and compiled (see the module docstring). Graph breaks, compile errors and
    recompiles are recorded, not raised.

    Raises:
        SubjectRaised: the subject raised outside torch.compile (eager decode, prefill, reset).
        ValueError: a malformed case.
    """
    import torch
    from torch._dynamo.utils import counters

    params = ctx.case.params
    seqs = _sequences(ctx)
    run = ProtocolRun(sequences=seqs)

    def eager_step(name, s, kwargs):
        run.eager[(name, s)] = _logits(ctx.model.model(**kwargs))

    try:
        _drive(ctx, seqs, eager_step)
    except Exception as exc:  # noqa: BLE001 - the subject's failure, reported on the item
        raise SubjectRaised("eager decode", exc) from exc

    mode = params.mode
    cudagraphs = mode in ("reduce-overhead", "max-autotune")
    torch.compiler.reset()
    counters.clear()

    def compile_fn(fn):
        return torch.compile(fn, fullgraph=fullgraph, dynamic=params.dynamic, backend=params.backend, mode=mode)

    # a model written from scratch compiles the decode step its adapter declares (kvconform's bookkeeping stays eager)
    own = getattr(ctx.model.model, "compiled_forward", None)
    compiled = own(compile_fn, ctx.subject.name) if callable(own) else compile_fn(ctx.model.model.forward)
    state = {"warm": False, "dead": False}

    def compiled_step(name, s, kwargs):
        where = f"{name} step {s + 1}"
        if state["dead"]:
            run.compiled[(name, s)] = None
            ctx.model.model(**kwargs)
            return
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        if not state["warm"]:
            start = time.perf_counter()
            try:
                out = compiled(**kwargs)
            except Exception as exc:  # noqa: BLE001 - the subject's (or the model's) failure to compile
                run.compile_seconds = time.perf_counter() - start
                _record_compile_failure(run, exc)
                state["dead"] = True
                run.compiled[(name, s)] = None
                return
            run.compile_seconds = time.perf_counter() - start
            state["warm"] = True
            torch.compiler.set_stance("fail_on_recompile")
            run.compiled_calls += 1
            run.compiled[(name, s)] = _logits(out)
            return
        try:
            out = compiled(**kwargs)
        except RuntimeError as exc:
            if _RECOMPILE not in str(exc):
                raise
            guard, source = _first_guard(str(exc))
            run.recompiles.append(Recompile(where, guard, source))
            run.eager_fallbacks += 1
            run.compiled[(name, s)] = None
            ctx.model.model(**kwargs)
            return
        run.compiled_calls += 1
        run.compiled[(name, s)] = _logits(out)

    try:
        _drive(ctx, seqs, compiled_step)
    except Exception as exc:  # noqa: BLE001 - the subject's failure, reported on the item
        raise SubjectRaised("compiled decode (eager prefill / reset / a recompile's eager fallback)", exc) from exc
    finally:
        torch.compiler.set_stance("default")
        run.graph_breaks_counted = sum(counters["graph_break"].values())
        run.graphs = int(counters["stats"]["unique_graphs"])
        run.cudagraph_skips = int(counters["inductor"].get("cudagraph_skips", 0) or 0)
        torch.compiler.reset()
    return run


def compare_compiled(ctx, run: ProtocolRun):
    """``(max|compiled − eager|, tolerance, noise floor, where)`` over the steps that ran compiled.

    The noise floor is the usual one (case-dtype uncached forward vs the float64 oracle) over the decode positions
    of each sequence; the tolerance ``max(k · floor, abs_min)`` (``ctx.tolerance()``)."""
    prefill, steps = _protocol_shape(ctx.case)
    floor = 0.0
    for name, (enc, tokens) in run.sequences.items():
        oracle = ctx.oracle.logits(tokens, encoder_ids=enc)[:, prefill:]
        uncached = ctx.oracle.uncached(tokens, encoder_ids=enc)[:, prefill:]
        floor = max(floor, float((uncached - oracle).abs().max()))
    worst, where = 0.0, ""
    for key, got in run.compiled.items():
        if got is None:
            continue
        diff = float((got - run.eager[key]).abs().max())
        if diff != diff:  # NaN
            diff = float("inf")
        if diff > worst:
            worst, where = diff, f"{key[0]} step {key[1] + 1}"
    return worst, ctx.tolerance().bound(floor), floor, where


def _ops(ctx) -> str:
    prefill, steps = _protocol_shape(ctx.case)
    return (f"ops: prefill({prefill}, eager) → decode×{steps} compiled; reset() → same shape, new tokens; "
            f"fresh cache → same")


def _recompile_cause(rec: Recompile) -> str:
    guard = rec.guard
    attr = re.search(r"(\w+(?:\[[^\]]+\])?(?:\.\w+(?:\[\d+\])?)*)\s*==\s*-?\d+\b", guard)
    if attr and "size" not in guard and "stride" not in guard:
        name = attr.group(1).replace("kwargs['cache'].", "cache.").replace("L['kwargs']['cache'].", "cache.")
        return (f"the cache keeps a Python int ({name}) that changes every step; dynamo specialises on it, so every "
                f"step misses the graph (dynamic=False: a recompile per step up to the limit; dynamic=None: one "
                f"recompile to a SymInt graph that CUDA graphs re-record per value). Keep it in a tensor updated "
                f"in place (as StaticLayer.cumulative_length)")
    if "size" in guard or "stride" in guard or "tensor" in guard.lower():
        return ("a tensor the forward reads changes shape between steps (the cache grows or reallocates): a "
                "compileable cache must keep static shapes and addresses")
    if "id" in guard.lower() or "obj" in guard.lower():
        return "an object the graph guards on by identity is replaced between steps (new layer or buffer objects)"
    return "state read by the compiled forward changes between steps (see the guard)"


def _adapter_step(ctx) -> str | None:
    """``Adapter.decode_step`` (or ``.forward``): the step a model written from scratch declares compiled
    (``kvconform.scratch.compiled_decode``), or None for a transformers model."""
    adapter = getattr(ctx.model.model, "adapter", None)
    if adapter is None:
        return None
    declared = getattr(adapter, "compiled_decode", None)
    step = declared.get("step") if isinstance(declared, dict) else None
    step = step or ("decode_step" if callable(getattr(adapter, "decode_step", None)) else "forward")
    return f"{type(adapter).__name__}.{step}"


def _adapter_recompile_cause(step: str, rec: Recompile) -> str:
    """The likely cause of a recompile of a from-scratch model's compiled ``step``, in its author's terms."""
    guard = rec.guard
    value = re.search(r"^(?:L\[['\"])?(\w+)(?:['\"]\])?(\S*)\s*==\s*-?\d+\b", guard)
    if value and "size" not in guard and "stride" not in guard:
        name = value.group(1) + value.group(2)
        return (f"{step} reads a Python int ({name}) that changes every step: torch.compile specialises on it, so "
                f"every step misses the graph and recompiles (dynamic=False: until the recompile limit, then it runs "
                f"eagerly). Keep the write position in a tensor: the pos tensor kvconform passes decode_step (as "
                f"gpt-fast's input_pos), or an int64 tensor in the cache updated in place (cache_pos.add_(T))")
    if "size" in guard or "stride" in guard or "tensor" in guard.lower():
        return (f"a tensor {step} reads changes shape between steps (a buffer grown with torch.cat or sliced to the "
                f"tokens held): a compiled decode step keeps static shapes — preallocate [B, H, max_len, D] buffers, "
                f"write with index_copy_ at pos, and mask the slots not written yet")
    return f"state {step} reads changes between steps (see the guard)"


def _recompile_lines(run: ProtocolRun, total: int) -> list[str]:
    rec = run.recompiles[0]
    wheres = sorted({r.where.split(" ")[0] for r in run.recompiles})
    label = {"A": "decode steps", "B": "after reset()", "C": "on a fresh cache"}
    return [
        f"{len(run.recompiles)} of {total} compiled calls after the warm-up needed a recompile "
        f"({', '.join(label[w] for w in wheres)}), but should be 0",
        f"first at {rec.where}: guard failed: {rec.guard}" + (f"  [{rec.source}]" if rec.source else ""),
    ]


def _run_or_fail(ctx, fullgraph):
    try:
        return run_protocol(ctx, fullgraph=fullgraph)
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache fails outside torch.compile too (see the logits and lifecycle families)")


def _post_warmup_calls(ctx) -> int:
    _, steps = _protocol_shape(ctx.case)
    return 3 * steps - 1


@register("compile", cost=8.0, needs=("compile",), applies=_applies(True), params=COMPILE_PARAMS, ops=COMPILE_OPS,
          validate=_protocol_case, adapter_full_tier=ADAPTER_FULL_TIER)
def check_compile_static_decode(ctx):
    """A cache declaring ``is_compileable`` decodes under ``torch.compile(fullgraph=True)``: no graph break, zero
    recompiles after the warm-up (steps, ``reset()``, a fresh cache), compiled logits equal eager (and, with CUDA
    graphs, no cudagraph skips)."""
    run = _run_or_fail(ctx, fullgraph=True)
    worst, tol, floor, where = compare_compiled(ctx, run)
    total = _post_warmup_calls(ctx)
    ctx.metrics.update(compile_s=round(run.compile_seconds, 2), recompiles=len(run.recompiles),
                       compiled_calls=run.compiled_calls, max_abs=worst, tolerance=tol, noise_floor=floor,
                       graph_breaks=int(run.graph_break is not None), guard=run.recompiles[0].guard
                       if run.recompiles else None, mode=ctx.case.params.mode)
    mode = ctx.case.params.mode
    step = _adapter_step(ctx)
    compile_line = (f"torch.compile({step or 'model.forward'}, fullgraph=True, dynamic=False"
                    f"{', mode=' + repr(mode) if mode else ''})")
    if run.graph_break or run.error:
        ctx.fail([
            (f"graph break under torch.compile(fullgraph=True): {run.graph_break}" if run.graph_break else
             f"torch.compile raised {run.error}"),
            f"at {run.graph_break_where}" if run.graph_break_where else "",
            f"compiled as: {compile_line}; {_ops(ctx)}",
            "likely cause: " + (
                (f"{step} calls something dynamo cannot trace (see the line named: a builtin such as print or "
                 f"time.perf_counter, a C extension, logging) although the adapter declares it compiled with "
                 f"fullgraph=True: move it out of the decode step" if step else
                 "the cache calls something dynamo cannot trace (data-dependent Python control flow on "
                 "a tensor, .tolist(), .numpy()) although it declares is_compileable")
                if run.graph_break else "the cache or model is not traceable (see the exception)"),
        ], {"graph_break": run.graph_break, "error": run.error})
    if run.recompiles:
        ctx.fail([
            *_recompile_lines(run, total),
            f"compiled as: {compile_line}, then set_stance('fail_on_recompile'); misses ran eagerly",
            _ops(ctx),
            "likely cause: " + (_adapter_recompile_cause(step, run.recompiles[0]) if step else
                                _recompile_cause(run.recompiles[0])),
        ], {"recompiles": len(run.recompiles), "guard": run.recompiles[0].guard})
    if worst > tol:
        ctx.fail([
            f"max|compiled − eager logits| = {worst:.1e}, but should be ≤ {tol:.1e} "
            f"({ctx.tolerance().describe(floor)})",
            f"worst at {where}",
            f"compiled as: {compile_line}; {_ops(ctx)}",
            "likely cause: the compiled graph reads stale cache state (an update not visible to the graph, a "
            "mutation dynamo did not replay) or a miscompile",
        ], {"max_abs": worst, "tolerance": tol})
    if run.cudagraph_skips:
        ctx.fail([
            f"CUDA graphs were skipped {run.cudagraph_skips} time(s) under mode={mode!r}, but should be 0",
            "reasons: rerun with TORCH_LOGS=cudagraphs (inductor logs 'skipping cudagraphs due to ...')",
            f"compiled as: {compile_line}; {_ops(ctx)}",
            "likely cause: the cache mutates or reallocates tensors CUDA graphs need at static addresses (mark them "
            "with torch._dynamo.mark_static_address, update in place)",
        ], {"cudagraph_skips": run.cudagraph_skips})


@register("compile", cost=8.0, needs=("compile",), applies=_applies(False), params=COMPILE_PARAMS, ops=COMPILE_OPS,
          validate=_protocol_case, adapter_full_tier=ADAPTER_FULL_TIER)
def check_compile_claim(ctx):
    """A cache declaring ``is_compileable = False``, compiled anyway (``fullgraph=False``, as a user compiling the
    model would): compiled logits equal eager and nothing crashes. The claim itself is reported: *confirmed* (the
    decode loop graph-breaks or needs recompiles; the first reason is kept) or *conservative* (it compiled into one
    graph with no recompile on this model — not a fault: CUDA-graph static addresses are not tested here)."""
    run = _run_or_fail(ctx, fullgraph=False)
    worst, tol, floor, where = compare_compiled(ctx, run)
    total = _post_warmup_calls(ctx)
    breaks = run.graph_breaks_counted + (1 if run.graph_break else 0)
    confirmed = bool(breaks or run.recompiles or run.graphs > 1)
    reason = (run.recompiles[0].guard if run.recompiles else
              run.graph_break or (f"{run.graphs} graphs (graph breaks)" if run.graphs > 1 else None))
    ctx.metrics.update(compile_s=round(run.compile_seconds, 2), recompiles=len(run.recompiles), graphs=run.graphs,
                       graph_breaks=breaks, compiled_calls=run.compiled_calls, max_abs=worst, tolerance=tol,
                       noise_floor=floor, claim="confirmed" if confirmed else "conservative", reason=reason)
    if run.error:
        ctx.fail([
            f"torch.compile({_adapter_step(ctx) or 'model.forward'}, fullgraph=False) raised {run.error}",
            "(is_compileable=False: graph breaks and recompiles are expected, a crash is not)",
            _ops(ctx),
            "likely cause: the cache does something dynamo mis-traces instead of graph-breaking on it (a user "
            "compiling the model with this cache gets an exception)",
        ], {"error": run.error})
    if worst > tol:
        ctx.fail([
            f"max|compiled − eager logits| = {worst:.1e}, but should be ≤ {tol:.1e} "
            f"({ctx.tolerance().describe(floor)})",
            f"worst at {where} (is_compileable=False, compiled anyway with fullgraph=False; "
            f"{run.compiled_calls} of {total + 1} steps ran compiled)",
            _ops(ctx),
            "likely cause: under torch.compile the cache's state goes stale (a side effect dynamo does not replay): "
            "a user compiling the model gets silently wrong logits",
        ], {"max_abs": worst, "tolerance": tol})


# ------------------------------------------------------------------------------------------------ static addresses
class BufferAddresses:
    """Observer: after every forward, ``{tensor name: (data_ptr, storage data_ptr)}`` of every tensor the cache holds
    (``tensors_of``), as ``(step label, addresses)`` in ``rows``."""

    def __init__(self):
        self.rows: list[tuple] = []

    def after_forward(self, runner, step):
        """Record the cache's buffer addresses after ``step``."""
        self.rows.append((step.label, {k: (t.data_ptr(), t.untyped_storage().data_ptr())
                                       for k, t in tensors_of(runner.cache).items()}))


class ReturnedBuffers:
    """Observer: whether the keys each single-token ``update()`` returns share storage with a tensor the cache holds
    (``tensors_of``). A fixed-size cache hands attention its own buffers; a copy breaks CUDA-graph replay. The
    wrapper sits on the cache *instance* (both halves of an encoder-decoder cache) until ``remove()``.
    ``copies``: ``[(step label, layer_idx)]`` of calls that returned a copy."""

    def __init__(self, cache):
        self.copies: list = []
        self._label = None
        self._returned: list = []
        self._targets = [c for c in (getattr(cache, "self_attention_cache", None),) if c is not None] or [cache]
        self._cache = cache
        for target in self._targets:
            original = target.update

            def update(key_states, value_states, layer_idx, *args, _original=original, **kwargs):
                out = _original(key_states, value_states, layer_idx, *args, **kwargs)
                if key_states.shape[-2] == 1 and isinstance(out, tuple) and hasattr(out[0], "untyped_storage"):
                    self._returned.append((layer_idx, out[0].untyped_storage().data_ptr()))
                return out

            target.update = update

    def remove(self):
        """Take the wrappers off again."""
        for target in self._targets:
            target.__dict__.pop("update", None)

    def after_forward(self, runner, step):
        """Compare what this forward's single-token ``update()`` calls returned with the cache's storages."""
        if self._returned:
            held = {t.untyped_storage().data_ptr() for t in tensors_of(self._cache).values()}
            self.copies += [(step.label, i) for i, ptr in self._returned if ptr not in held]
        self._returned = []


def _check_allocation(ctx, cache, label):
    """A fixed-size cache built with ``max_cache_len`` (its factory accepts it) allocates no layer beyond it: fail
    naming the layer, its key buffer's length and the bound."""
    from kvconform.subjects import accepted_kwargs

    if "max_cache_len" not in accepted_kwargs(ctx.subject.factory, {"max_cache_len": 1}):
        return
    import torch

    for i, layer in layer_items(self_half(cache)):
        keys = read_attr(layer, "keys")
        if isinstance(keys, torch.Tensor) and keys.dim() >= 3 and keys.shape[-2] > ctx.max_cache_len:
            ctx.fail([
                f"layer {i} allocated {keys.shape[-2]} slots for its keys, but the cache was built with "
                f"max_cache_len={ctx.max_cache_len}",
                f"ops: {ctx.case.ops_label()}   [after {label}]",
                "likely cause: the cache allocates its fixed-size buffers from another length than max_cache_len "
                "(a rounded-up size, a config default such as max_position_embeddings, or a doubled length), so "
                "it holds memory it never uses and its mask covers slots beyond the requested length",
            ], {"allocated": int(keys.shape[-2]), "max_cache_len": ctx.max_cache_len, "failed_at": label})


@register("compile", cost=8.0, needs=("forward",), applies=_applies(True), params=OP_PARAMS,
          ops=OpRule(min_forwards=2, why="it compares buffer addresses between forwards"))
def check_static_addresses(ctx):
    """A cache that says ``is_compileable`` keeps every buffer at the same address at every step: ``update()`` writes
    into the tensors allocated by the first forward, in place. CUDA graphs replay the addresses they captured and
    ``torch.compile`` guards on them, so a buffer that moves (an out-of-place ``update``, a ``torch.cat``, a fresh
    tensor assigned each step) breaks them even where an eager run, or a compiled run on CPU, looks right."""
    probe = BufferAddresses()
    cache = ctx.new_cache()
    returns = ReturnedBuffers(cache)
    runner = Runner(ctx, cache, observers=[probe, returns])
    try:
        runner.run()
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache does not support this sequence of calls (see the exception)")
    finally:
        returns.remove()
    if not probe.rows:
        raise ValueError(f"case {ctx.case.id}: check_static_addresses needs forwards (prefill, decode)")
    first_label, first = probe.rows[0]
    ctx.metrics.update(steps=len(probe.rows), buffers=len(first))
    _check_allocation(ctx, cache, first_label)
    for label, addresses in probe.rows[1:]:
        moved = sorted(k for k in first if k in addresses and addresses[k] != first[k])
        appeared = sorted(set(addresses) - set(first))
        if moved or appeared:
            ctx.fail([
                f"is_compileable is True, but after {label} {len(moved)} buffer(s) are at another address than after "
                f"{first_label}" + (f" and {len(appeared)} new one(s) appeared" if appeared else "")
                + f": {', '.join((moved + appeared)[:4])}{' ...' if len(moved) + len(appeared) > 4 else ''}",
                f"ops: {ctx.case.ops_label()}   [moved at {label}]",
                "likely cause: update() writes out of place (x = torch.cat(...), x = x.index_copy(...), a new "
                "tensor per step) instead of into the buffers it allocated (x.index_copy_(...), x[..., i] = ...); "
                "CUDA graphs and torch.compile captured the first addresses",
            ], {"moved": moved, "appeared": appeared, "failed_at": label})
    # buffers that stay put but are not what update() hands attention (checked after the addresses: a buffer that
    # moves makes what update() returned stale too, and the move is the cause)
    if returns.copies:
        label, layer_idx = returns.copies[0]
        ctx.fail([
            f"is_compileable is True, but at {label} update(layer_idx={layer_idx}) returned keys/values that are "
            f"not the cache's own buffers (their storage is none of the tensors the cache holds): "
            f"{len(returns.copies)} such call(s)",
            f"ops: {ctx.case.ops_label()}   [first at {label}]",
            "likely cause: update() returns copies (.clone(), torch.cat, a sliced-and-copied tensor) instead of "
            "the buffers it wrote into: a CUDA graph captured on those copies replays stale keys, and "
            "torch.compile's in-place contract for static caches is broken",
        ], {"returned_copies": len(returns.copies), "failed_at": label})
