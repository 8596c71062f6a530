"""Family ``memory``: the bytes a cache holds, against the formula for what it must hold.

How bytes are counted (``held_bytes``): every tensor reachable from a cache layer's attributes (through lists,
tuples, dicts and plain objects, not through ``nn.Module``s or configs), counted once per **storage**, at the size
of the storage: a view of a larger buffer keeps that whole buffer alive, so it costs what the buffer costs. A
wrapper tensor subclass (optimum-quanto's ``QTensor``: ``WeightQBitsTensor`` → packed ``_data``, ``_scale``,
``_shift``) is counted through its inner tensors (``__tensor_flatten__``), because its own ``nbytes`` is its
*logical* size (measured on transformers 5.24, see ARCHITECTURE.md).

The formula, per layer (``expected_layer``), with ``B`` batch, ``H_kv`` key/value heads, ``D`` head size and ``b``
bytes per element of the K/V the model hands the cache, ``S`` tokens fed so far::

    full attention     2·B·H_kv·D·b · S                      (2·L·B·H_kv·S·D·b summed over L layers)
    sliding attention  2·B·H_kv·D·b · min(S, window)
    static layer       2·B·H_kv·D·b · max_cache_len          (preallocated; sliding: min(window, max_cache_len))
    linear attention   conv state + recurrent state bytes    (independent of S)
    quantized          the band [S·q, S·q + residual·(1 − q)] · 2·B·H_kv·D·b, with q = nbits/(8b) + 2/group
                       (a scale and a shift per group; fp8: q = 1/b), ±10 %

``H_kv``, ``D``, ``b`` and the linear-state sizes are read from what the model actually hands a cache: the same ops
are run on kvconform's ``ReferenceCache`` (which stores exactly what it is given) and its tensors' shapes are used —
so the formula works for every architecture without a table of config attribute names, and a cache that stores K/V
repeated across the query heads (``H`` instead of ``H_kv``) is measured against ``H_kv``. Which row applies comes
from the subject layer's own declarations: ``get_max_length()`` (−1 = unbounded, else its capacity) and
``is_compileable`` (a compileable layer preallocates its capacity; a dynamic one holds ``min(S, capacity)``);
quantization parameters from ``nbits`` / ``q_group_size`` / ``residual_length`` (``QuantizedLayer``) or
``fp8_dtype`` (``Fp8QuantizedLayer``).

Verdict: an exact subject fails when a layer holds more than its formula plus ``slack_bytes`` (default 256 bytes
per layer, for bookkeeping such as ``StaticLayer.cumulative_length``); holding less is reported in the metrics
(the logits family judges whether the fewer bytes are still correct). A quantized layer fails outside its band
(both sides: more bytes than declared, or fewer bits than declared). Bytes are measured after every op of the case
(``prefill``/``decode``/``chunk``; ``reset`` sets ``S`` to 0), so a history that survives ``reset()`` is caught too.

On CUDA, ``check_memory_cuda_allocated`` compares ``torch.cuda.memory_allocated()`` deltas with the counted bytes
(memory held where attribute traversal cannot see it: closures, globals, class attributes), and
``check_offloaded_matches`` checks that an offloaded cache gives the logits of its non-offloaded subject and a
lower GPU peak while decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvconform import compat
from kvconform.checks import Param, register
from kvconform.checks._drive import SubjectRaised
# counting bytes lives in _drive (the quality family's compression checks count them too); re-exported here
from kvconform.checks._drive import cache_layers, held_bytes, held_tensors, storage_bytes  # noqa: F401
from kvconform.checks._interpreter import Runner
from kvconform.checks._diagnosis import describe_raise, fail_raised
from kvconform.checks._observe import run_observed
from kvconform.oracle import Tolerance

DEFAULT_SLACK_BYTES = 256
QUANT_BAND = 0.10
MEMORY_OPS = ("prefill", "decode", "chunk", "reset")


# ------------------------------------------------------------------------------------------------ the formula
@dataclass
class LayerShape:
    """What one layer must hold, measured on the reference cache.

    Attributes:
        kind: ``"attention"``, ``"linear"`` or ``"hybrid"``.
        token_bytes: bytes of one token's keys + values over the batch (``B·H_kv·(D_k + D_v)·b``), 0 if none.
        dims: ``(B, H_kv, D, b)`` for the message (D of the keys).
        state_bytes: conv + recurrent state bytes (linear / hybrid layers), 0 if none.
    """

    kind: str
    token_bytes: int = 0
    dims: tuple = ()
    state_bytes: int = 0


def reference_shapes(ref_cache) -> dict[str, LayerShape]:
    """``{label: LayerShape}`` from a ``ReferenceCache`` (or ``EncoderDecoderCache`` of them) after a run."""
    out = {}
    for label, layer in cache_layers(ref_cache):
        token_bytes, dims, kv_bytes = 0, (), 0
        chunks = getattr(layer, "key_chunks", None)
        if chunks:
            k, v = chunks[0], layer.value_chunks[0]
            token_bytes = k.shape[0] * k.shape[1] * (k.shape[-1] + v.shape[-1]) * k.element_size()
            dims = (k.shape[0], k.shape[1], k.shape[-1], k.element_size())
            kv_bytes = storage_bytes(list(layer.key_chunks) + list(layer.value_chunks))
        state_bytes = held_bytes(layer) - kv_bytes
        kind = "hybrid" if token_bytes and state_bytes else "attention" if token_bytes else "linear"
        out[label] = LayerShape(kind, token_bytes, dims, state_bytes)
    return out


def quant_params(layer) -> tuple | None:
    """``(nbits, group, residual)`` a quantized layer declares, or None for an exact layer.

    ``Fp8QuantizedLayer`` → ``(8, None, 0)`` (one per-tensor scale, no residual); ``QuantizedLayer`` (quanto, hqq)
    → ``(nbits, q_group_size, residual_length)``.
    """
    if hasattr(layer, "fp8_dtype"):
        return (8, None, 0)
    nbits = getattr(layer, "nbits", None)
    if isinstance(nbits, int):
        return (nbits, getattr(layer, "q_group_size", None), int(getattr(layer, "residual_length", 0) or 0))
    return None


def quant_ratio(nbits: int, group, elem_bytes: int) -> float:
    """Bytes of a quantized element relative to the original: ``nbits/(8·b)`` plus a scale and a shift (each ``b``
    bytes) per ``group`` elements. 4-bit g64 fp32: 0.156; 2-bit: 0.094; fp8 (no group): 0.25."""
    return nbits / (8 * elem_bytes) + (2 / group if group else 0.0)


@dataclass
class Expectation:
    """The expected bytes of one layer: ``[low, high]``, the formula's value ``exact`` (for a quantized layer: all
    tokens quantized), ``full_precision`` (the same layer unquantized) and the derivation ``formula`` (messages)."""

    low: int
    high: int
    formula: str
    exact: int
    lossy: bool = False
    full_precision: int = 0

    def __post_init__(self):
        self.full_precision = self.full_precision or self.exact


def expected_layer(shape: LayerShape, layer, tokens: int, slack: int) -> Expectation:
    """Expected bytes of subject ``layer`` holding ``tokens`` tokens (see the module docstring)."""
    state = shape.state_bytes
    if not shape.token_bytes:
        return Expectation(state, state + slack, f"conv+recurrent states {state} B (independent of S)", state)
    try:
        capacity = compat.max_length(layer)
    except Exception:  # noqa: BLE001 - an incomplete layer: treat as unbounded
        capacity = -1
    note = ""
    declared_len = getattr(layer, "max_cache_len", None)
    if capacity < 0 and isinstance(declared_len, int) and declared_len > 0:
        # transformers 5.24: LinearAttentionAndStaticFullAttentionLayer (StaticCache on FalconH1) preallocates
        # max_cache_len but its get_max_length() resolves to the linear mixin's -1
        capacity, note = declared_len, "; get_max_length() says -1"
    preallocates = bool(getattr(layer, "is_compileable", False)) and capacity > 0
    if capacity < 0:
        held, rule = tokens, f"S={tokens}"
    elif preallocates:
        held, rule = capacity, f"max_cache_len={capacity} (preallocated{note})"
    else:
        held, rule = min(tokens, capacity), f"min(S={tokens}, window={capacity})"
    B, H, D, b = shape.dims
    kv = held * shape.token_bytes
    text = f"2·B{B}·H_kv{H}·D{D}·{b}B · {rule} = {kv} B" + (f" + states {state} B" if state else "")
    q = quant_params(layer)
    if q is None:
        return Expectation(kv + state, kv + state + slack, text, kv + state)
    nbits, group, residual = q
    ratio = quant_ratio(nbits, group, b)
    low = kv * ratio
    high = kv * ratio + min(residual, held) * shape.token_bytes * (1 - ratio)
    qtext = f"{nbits}-bit" + (f" group {group}" if group else "") + (f", residual {residual}" if residual else "")
    return Expectation(int(low * (1 - QUANT_BAND)) + state, int(high * (1 + QUANT_BAND)) + state + slack,
                       f"{qtext}: {ratio:.3f} × ({text})", int(low) + state, lossy=True, full_precision=kv + state)


# ------------------------------------------------------------------------------------------------ driving the ops
class MemoryCheckpoints:
    """Observer of the memory checks: refuses ops outside ``MEMORY_OPS`` (``ValueError``) and, after each
    token-feeding op, calls ``on_checkpoint(label, tokens_held, after_reset)``."""

    def __init__(self, on_checkpoint):
        self.on_checkpoint, self.after_reset, self.current = on_checkpoint, False, None

    def before_op(self, runner, op, op_index):
        """Refuse an op the memory checks cannot account for."""
        if op.name not in MEMORY_OPS:
            raise ValueError(f"case {runner.ctx.case.id}: op {op.name!r} is not supported by the memory checks "
                             f"(allowed: {', '.join(MEMORY_OPS)})")
        self.current = op

    def after_op(self, runner, op, op_index):
        """A checkpoint after every op but ``reset``."""
        if op.name == "reset":
            self.after_reset = True
        else:
            self.on_checkpoint(op.label, runner.length, self.after_reset)


def run_memory_ops(ctx, cache, on_checkpoint):
    """Run the case's ops on ``cache`` through the interpreter (explicit positions, no padding); after each
    token-feeding op call ``on_checkpoint(label, tokens_held, after_reset)``. Returns the first encoder input
    ``[B, E]`` (None for decoder-only models).

    Raises:
        SubjectRaised: the subject raised during an op (names the op).
        ValueError: an op outside ``MEMORY_OPS``.
    """
    probe = MemoryCheckpoints(on_checkpoint)
    runner = Runner(ctx, cache, "explicit", padding=[], observers=[probe])
    encoder_ids = runner.encoder_ids
    try:
        runner.run(parked=False)
    except SubjectRaised as exc:  # name the op, not the step within it
        raise SubjectRaised(probe.current.label, exc.cause) from exc.cause
    return encoder_ids


@dataclass
class Checkpoint:
    """Bytes after one op: per layer ``(label, held, Expectation)``."""

    op: str
    tokens: int
    after_reset: bool = False
    layers: list = field(default_factory=list)

    @property
    def held(self) -> int:
        return sum(h for _, h, _ in self.layers)

    @property
    def formula(self) -> int:
        return sum(e.exact for _, _, e in self.layers)

    @property
    def full_precision(self) -> int:
        return sum(e.full_precision for _, _, e in self.layers)

    def worst(self):
        """The layer furthest outside its expectation, as ``(label, held, exp, excess)`` (excess > 0: too many
        bytes; < 0: too few for a lossy band), or None when every layer is within."""
        bad = []
        for label, held, exp in self.layers:
            if held > exp.high:
                bad.append((label, held, exp, held - exp.high))
            elif exp.lossy and held < exp.low:
                bad.append((label, held, exp, held - exp.low))
        return max(bad, key=lambda x: abs(x[3])) if bad else None


def _ops_label(ctx, upto=None) -> str:
    return ctx.case.ops_label() + (f"   [measured after {upto}]" if upto else "")


def _mib(n) -> str:
    return f"{n:,} B" if abs(n) < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


_SHAPES: dict = {}
"""Reference shapes per (model, dtype, case): the same for every subject of a run, so measured once."""


def _shapes_for(ctx) -> dict:
    key = (ctx.model.name, ctx.model.source, str(ctx.model.dtype), ctx.case.id, ctx.case.batch, ctx.reference.name)
    if key not in _SHAPES:
        ref = ctx.new_cache(ctx.reference)
        try:
            run_memory_ops(ctx, ref, lambda *_: None)
        except SubjectRaised as exc:
            ctx.fail([f"the reference cache raised {describe_raise(exc)} — cannot derive the formula",
                      f"ops: {_ops_label(ctx)}", "likely cause: the model does not support these ops"],
                     {"model_at_fault": True})
        if len(_SHAPES) > 64:
            _SHAPES.clear()
        _SHAPES[key] = reference_shapes(ref)
    return _SHAPES[key]


@register("memory", needs=("forward",), params={
    "slack_bytes": Param(int, default=DEFAULT_SLACK_BYTES, min=0, doc="bytes per layer allowed above the formula")})
def check_memory_bytes(ctx):
    """The bytes each cache layer holds, after every op of the case, are within the formula for what it must hold
    (full: S tokens, sliding: min(S, window), static: max_cache_len, linear: its states, quantized: its band).

    A subject that does not declare capability ``reset`` is measured up to the case's first ``reset`` op."""
    slack = int(ctx.case.params.get("slack_bytes", DEFAULT_SLACK_BYTES))
    if "reset" not in ctx.subject.capabilities and any(op.name == "reset" for op in ctx.case.ops):
        import dataclasses

        first = next(i for i, op in enumerate(ctx.case.ops) if op.name == "reset")
        ctx.case = dataclasses.replace(ctx.case, ops=ctx.case.ops[:first])
        ctx.metrics["note"] = f"{ctx.subject.name} does not declare 'reset': measured up to the first reset"
    shapes = _shapes_for(ctx)
    cache = ctx.new_cache()
    checkpoints: list[Checkpoint] = []

    def measure(label, tokens, after_reset):
        cp = Checkpoint(label, tokens, after_reset)
        layers = dict(cache_layers(cache))
        for name, layer in layers.items():
            shape = shapes.get(name)
            if shape is None:
                continue
            enc = ctx.case.encoder_len if name.startswith("cross") else tokens
            cp.layers.append((name, held_bytes(layer), expected_layer(shape, layer, enc, slack)))
        extra = set(layers) - set(shapes)
        if extra:  # layers the reference does not have: everything they hold is unexplained
            for name in sorted(extra):
                cp.layers.append((name, held_bytes(layers[name]), Expectation(0, slack, "no such layer", 0)))
        checkpoints.append(cp)

    try:
        run_memory_ops(ctx, cache, measure)
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache does not support this sequence of calls (see the exception)")
    if not checkpoints:
        raise ValueError(f"case {ctx.case.id}: no token-feeding op, nothing to measure")
    last = checkpoints[-1]
    peak = max(checkpoints, key=lambda c: c.held)
    ctx.metrics.update(_checkpoint_metrics(last), peak_bytes=peak.held, layers=len(last.layers),
                       per_op=[[c.op, c.tokens, c.held, c.formula] for c in checkpoints])
    failing = [(cp, cp.worst()) for cp in checkpoints if cp.worst() is not None]
    if not failing:
        return
    cp, (label, held, exp, excess) = max(failing, key=lambda f: abs(f[1][3]) / max(f[1][2].exact, 1))
    ctx.metrics.update(_checkpoint_metrics(cp))  # every number of a failure from the failing checkpoint
    if excess > 0:
        observed = f"{label} holds {_mib(held)}, but should hold ≤ {_mib(exp.high)}"
    else:
        observed = f"{label} holds {_mib(held)}, but should hold ≥ {_mib(exp.low)}"
    ratio = held / exp.exact if exp.exact else float("inf")
    per_op = ", ".join(f"{c.op} {h / e.exact:.2f}×" for c in checkpoints for name, h, e in c.layers
                       if name == label and e.exact)
    ctx.fail([
        observed + f" ({ratio:.2f}× the formula)",
        f"formula: {exp.formula}" + ("" if exp.lossy else f" (+ slack {slack} B)"),
        f"whole cache: {_mib(cp.held)} held vs {_mib(cp.formula)} by the formula after S={cp.tokens} tokens",
        f"{label} held/formula after each op: {per_op}",
        f"ops: {_ops_label(ctx, cp.op + (' after the reset' if cp.after_reset else ''))}",
        "likely cause: " + _memory_cause(exp, excess, shapes, label, checkpoints),
    ], {"bytes_held": cp.held, "bytes_formula": cp.formula, "failed_at": cp.op, "layer": label,
        "layer_bytes": held, "layer_bound": exp.high if excess > 0 else exp.low})


def _checkpoint_metrics(c) -> dict:
    """The JSON metrics of one memory checkpoint (bytes, tokens, ratios: all of the same step, ``measured_at``)."""
    return dict(measured_at=c.op, bytes_held=c.held, bytes_formula=c.formula, tokens=c.tokens,
                ratio=round(c.held / c.formula, 4) if c.formula else None, bytes_full_precision=c.full_precision,
                ratio_to_full_precision=round(c.held / c.full_precision, 4) if c.full_precision else None)


def _memory_cause(exp, excess, shapes, label, checkpoints) -> str:
    """The likeliest cause, from how ``label``'s bytes relate to its formula over all checkpoints."""
    if excess < 0:
        return ("the layer holds fewer bytes than its declared quantization can: keys/values are stored at fewer "
                "bits (or fewer tokens) than declared")
    if exp.lossy:
        return "the quantized layer holds more than its declared bits and group size allow (a full-precision copy?)"
    shape = shapes.get(label)
    if shape is not None and not shape.token_bytes:
        return "a linear-attention layer whose state bytes depend on the tokens fed: it keeps past states"
    series = [(cp.op, held, e) for cp in checkpoints for name, held, e in cp.layers if name == label]
    ratios = [held / e.exact for _, held, e in series if e.exact]
    over = [held > e.high for _, held, e in series]
    if ratios and all(over) and max(ratios) - min(ratios) < 0.05 and round(ratios[0]) >= 2:
        heads = f" (H_kv = {shape.dims[1]})" if shape is not None and shape.dims else ""
        return (f"a constant {round(ratios[0])}× the formula at every op: keys/values stored repeated across the "
                f"query heads (repeat_kv) or kept twice{heads}")
    multi = [not op.startswith("decode") for op, _, _ in series]
    if any(over) and all(m for m, o in zip(multi, over) if o) and not all(over):
        return ("over only right after a multi-token op, back within the formula after a decode step: the layer "
                "keeps a slice (a view) of the whole prefill/chunk buffer instead of a copy of its window")
    if any(cp.after_reset and held > e.high for cp in checkpoints for name, held, e in cp.layers if name == label):
        return ("bytes survive reset(): superseded keys/values are kept somewhere reset() does not clear "
                "(a history list, a second buffer)")
    return ("the bytes grow faster than the tokens: superseded keys/values are kept (a history list, or views "
            "that pin old buffers)")


def _cuda_applies(subject, model, case, device="cpu"):
    import torch

    if not (str(device).startswith("cuda") and torch.cuda.is_available()):
        return "requires CUDA (torch.cuda.memory_allocated; run with --kvconform-device cuda on a GPU)"
    return None


@register("memory", needs=("forward",), applies=_cuda_applies, params={
    "cuda_slack_bytes": Param(int, default=1 << 20, min=0, doc="bytes allowed above the counted bytes")})
def check_memory_cuda_allocated(ctx):
    """On CUDA: the allocator's view agrees with the counted bytes — ``memory_allocated`` after the ops minus before
    (outputs dropped) is within ``slack`` of ``held_bytes(cache)``, so nothing is held where attribute traversal
    cannot see it (closures, globals, class attributes); the peak (``max_memory_allocated``) is reported."""
    import gc

    import torch

    device = next(ctx.model.model.parameters()).device
    slack = int(ctx.case.params.get("cuda_slack_bytes", 1 << 20))
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache = ctx.new_cache()
    try:
        run_memory_ops(ctx, cache, lambda *_: None)
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache does not support this sequence of calls (see the exception)")
    gc.collect()
    torch.cuda.synchronize(device)
    delta = torch.cuda.memory_allocated(device) - base
    peak = torch.cuda.max_memory_allocated(device) - base
    counted = held_bytes(cache)
    ctx.metrics.update(cuda_allocated_delta=delta, cuda_peak_delta=peak, bytes_held=counted)
    if delta > counted + slack:
        ctx.fail([
            f"torch.cuda.memory_allocated grew by {_mib(delta)}, but the cache's tensors account for "
            f"{_mib(counted)} (slack {_mib(slack)})",
            f"peak during the ops: {_mib(peak)} above the start",
            f"ops: {_ops_label(ctx)}",
            "likely cause: the cache keeps tensors outside its attributes (a closure, a global or class-level list, "
            "a hook) that are never released",
        ], {"cuda_allocated_delta": delta, "bytes_held": counted})


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


@register("memory", needs=("forward",), applies=_offloaded_row,
          params={"layers": Param(int, default=6, min=1, doc="decoder layers of the model copy")})
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

        steps = run_observed(dctx, cache, after_prefill)
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
