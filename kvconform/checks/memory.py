"""Family ``memory``: the bytes a cache holds, against the formula for what it must hold.

How bytes are counted (``held_bytes``): every tensor reachable from a cache layer's attributes (through lists,
tuples, dicts, plain objects and ``nn.Module``s — a module's own parameters and buffers, as litgpt's ``KVCache``
holds its k and v — but not through a transformers model or config), counted once per **storage**, at the size
of the storage: a view of a larger buffer keeps that whole buffer alive, so it costs what the buffer costs. A
wrapper tensor subclass (optimum-quanto's ``QTensor``: ``WeightQBitsTensor`` → packed ``_data``, ``_scale``,
``_shift``) is counted through its inner tensors (``__tensor_flatten__``), because its own ``nbytes`` is its
*logical* size (measured on transformers 5.24, see ARCHITECTURE.md). Each layer is counted without entering its cache
or its siblings; what the cache object owns beyond its layers — a vLLM-style page pool, block tables and a free list
its layers reach by a back-reference — is counted once as the pseudo-layer ``SHARED`` (``_measure.cache_bytes``),
held to what the layers leave of their bounds; tensors the model owns (``_measure.owned_by_model``: its weights, what
its modules or a model adapter keep, e.g. a rotary table a setup call rebuilds) are counted nowhere. A case that
holds tokens measured at 0 bytes is no pass (``Measured.blind``).

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
``is_compileable`` (a compileable layer preallocates its capacity; a dynamic one holds ``min(S, capacity)``) —
a declared capacity is never its own excuse: it is held to the ``max_cache_len`` kvconform built the cache with
(rounded up to whole pages; ``_allocation.capacity_over_asked``), so a cache asked for 64 tokens that preallocates
4,096 and says so fails at 64× its formula;
quantization parameters from ``nbits`` / ``q_group_size`` / ``residual_length`` (``QuantizedLayer``) or
``fp8_dtype`` (``Fp8QuantizedLayer``).

Verdict: an exact subject fails when a layer holds more than its formula plus ``slack_bytes`` (default 256 bytes
per layer, for bookkeeping such as ``StaticLayer.cumulative_length``); holding less is reported in the metrics
(the logits family judges whether the fewer bytes are still correct). A quantized layer fails outside its band
(both sides: more bytes than declared, or fewer bits than declared). Bytes are measured after every op of the case
(``prefill``/``decode``/``chunk``/``crop``; ``reset`` sets ``S`` to 0), so a history that survives ``reset()`` or
``crop()`` is caught too.

Allocation granularity (paged / block caches): a cache that allocates K/V in pages of ``P`` tokens holds up to a
page more than the formula. An exact, non-preallocated layer with granularity ``P > 1`` may hold at most **one page
per row** above its formula: ``P · token_bytes`` (= ``P·B·H_kv·(D_k + D_v)·b``) plus ``slack_bytes``. ``P`` is
either declared by the subject (``CacheSpec.page_size``, or a ``kvconform_page_size`` attribute on its class or
factory) or inferred per layer from the steps in which its held bytes grow (``infer_granularity``: single-token
forwards that allocate nothing, others that grow by one constant step of ``P`` tokens' bytes, and every growth a
multiple of that step). Neither: ``P = 1`` (no extra allowance). A cache that allocates more than one spare page, a
page per token, or never frees its pages on ``reset()`` still exceeds the bound, and the "likely cause" line says
which. The default cases reset but do not crop: a crop that slices keeps the sliced storage alive until the next
write (``DynamicCache``, ``ReferenceCache``: measured 2.29× the formula right after ``crop(-9)`` of 16 tokens, 1.00×
and 2.00× after two more decode steps), so a case that crops holds a cache to the bound only where its author
chooses to (``--kvconform-cases``). Metrics and messages name the granularity used and where it came from.

On CUDA, ``check_memory_cuda_allocated`` compares ``torch.cuda.memory_allocated()`` deltas with the counted bytes
(memory held where attribute traversal cannot see it: closures, globals, class attributes), and
``check_offloaded_matches`` checks that an offloaded cache gives the logits of its non-offloaded subject and a
lower GPU peak while decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvconform.checks import EXACT, LOSSY_FRESH, LOSSY_TWIN, OpRule, Param, register
from kvconform.checks._drive import SubjectRaised, measure_reference
from kvconform.checks._measure import cache_bytes, layers_problem, owned_by_model, storage_key
# counting bytes lives in _measure (the quality family's compression checks count them too); re-exported here
from kvconform.checks._measure import cache_layers, held_bytes, held_tensors, quant_params, storage_bytes  # noqa: F401
from kvconform.checks._allocation import (NO_POLICY, SHARED, TOKEN_BY_TOKEN, Allocation, Expectation, GrowthProbe,
                                          LayerShape, allocations, expected_layer, reference_shapes,
                                          buffer_tokens, granularities, granularity_summary, hint_applies,
                                          not_inferred)
from kvconform.checks._interpreter import Runner
from kvconform.checks._diagnosis import describe_raise, fail_raised
from kvconform.checks._observe import FORWARD_OPS, measured_at_batch_one, run_observed, up_to_undeclared_op
from kvconform.memo import MEMO
from kvconform.ops import OPS, op_names
from kvconform.ops import tokens_held as ops_tokens_held
from kvconform.oracle import Tolerance

DEFAULT_SLACK_BYTES = 256
MEMORY_OPS = op_names(copies=False, rows=("keep", "new", "permute"))
"""The ops the memory drivers account for: the token-feeding ops, crop, reset, and the row permutations of beam
search (reorder, swap_rows, beam_fork: the rows and tokens held stay the same, so the formula does too — a cache that
keeps the pages or buffers a row left behind after a reorder holds more than it)."""


# ------------------------------------------------------------------------------------------------ driving the ops
class MemoryCheckpoints:
    """Observer of the memory checks: refuses ops outside ``MEMORY_OPS`` (``ValueError``) and, after each
    token-feeding op and after ``crop``, calls ``on_checkpoint(label, tokens_held, after_reset)``."""

    def __init__(self, on_checkpoint):
        self.on_checkpoint, self.after_reset = on_checkpoint, False
        self.current: Any = None
        """The op being applied (an ``ops.Op``; None before the first)."""

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


def run_memory_ops(ctx, cache, on_checkpoint, observers=()):
    """Run the case's ops on ``cache`` through the interpreter (explicit positions, no padding); after each
    token-feeding op (and after ``crop``) call ``on_checkpoint(label, tokens_held, after_reset)``; ``observers``
    (e.g. a ``GrowthProbe``) see every forward too. Returns the first encoder input ``[B, E]`` (None for
    decoder-only models).

    Raises:
        SubjectRaised: the subject raised during an op (names the op).
        ValueError: an op outside ``MEMORY_OPS``.
    """
    probe = MemoryCheckpoints(on_checkpoint)
    runner = Runner(ctx, cache, "explicit", padding=[], observers=[probe, *observers])
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
    reported: int | None = None  # the cache's get_seq_length() there (None: it raised or is not an int)
    shared: int = 0
    """Bytes the cache object owns that no layer holds itself (a page pool its layers reach by a back-reference:
    ``_measure.cache_bytes``); judged as the pseudo-layer ``SHARED`` against what the layers leave of their bounds."""

    @property
    def held(self) -> int:
        return sum(h for _, h, _ in self.layers)

    @property
    def formula(self) -> int:
        return sum(e.exact for name, _, e in self.layers if name != SHARED)

    @property
    def full_precision(self) -> int:
        return sum(e.full_precision for name, _, e in self.layers if name != SHARED)

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


_SHAPES: dict = MEMO.table("memory.shapes")
"""Reference shapes per (model, dtype, case): the same for every subject of a run, so measured once."""


def _declared_shapes(ctx) -> dict:
    """A from-scratch model's formula (``kvconform.scratch``: no ReferenceCache runs it): one pseudo-layer
    ``"cache"`` holding ``layers × kv_heads`` heads of ``head_dim`` keys and values per token and row, at the rows
    the case ends with; ``{}`` where its adapter declares no ``kv_layout`` (the item is skipped, saying so)."""
    from kvconform.outcomes import CheckSkipped

    dims = getattr(ctx.model.model, "kv_token_dims", lambda: None)()
    if dims is None:
        raise CheckSkipped("the model adapter declares no kv_layout {'layers', 'kv_heads', 'head_dim'}: no K/V byte "
                           "formula to measure its cache against")
    probe = ctx.new_cache()
    run_memory_ops(ctx, probe, lambda *_: None)
    import torch

    heads, dim = dims
    size = torch.empty((), dtype=ctx.model.dtype).element_size()
    rows = int(getattr(probe, "batch", ctx.case.batch))
    return {"cache": LayerShape("attention", rows * heads * 2 * dim * size, (rows, heads, dim, size), 0, 0)}


def _shapes_for(ctx) -> dict:
    if ctx.reference is None:
        return _declared_shapes(ctx)

    def refused(exc):
        ctx.fail([f"the reference cache raised {describe_raise(exc)} — cannot derive the formula",
                  f"ops: {_ops_label(ctx)}", "likely cause: the model does not support these ops"],
                 {"model_at_fault": True})

    return measure_reference(ctx, _SHAPES, lambda ref: run_memory_ops(ctx, ref, lambda *_: None), reference_shapes,
                             refused)


LOSSY_BYTES = ("{subject} is lossy: its held bytes are judged by the quality family's compression check "
               "(check_compression), not by the exact cache's byte formula")
"""Why the byte-formula checks skip a lossy subject without a twin (they judge exact subjects and twins)."""


@register("memory", cost=1.5, needs=("forward",), judges=(EXACT, LOSSY_TWIN),
          ops=OpRule(allowed=MEMORY_OPS, min_forwards=1), unjudged={LOSSY_FRESH: LOSSY_BYTES}, params={
    "slack_bytes": Param(int, default=DEFAULT_SLACK_BYTES, min=0, doc="bytes per layer allowed above the formula")})
def check_memory_bytes(ctx):
    """The bytes each cache layer holds, after every op of the case, are within the formula for what it must hold
    (full: S tokens, sliding: min(S, window), static: max_cache_len, linear: its states, quantized: its band).

    A subject that does not declare the capability an op needs (``reset``, ``crop``, ``reorder``) is measured up to the
    case's first such op. A subject that raises at the case's batch (> 1) is measured at batch 1 as well
    (``_observe.measured_at_batch_one``): its bytes get a verdict where it runs. A paged subject may hold one page
    per row and layer above the formula (see the module docstring: its ``page_size``, declared or inferred); the
    metrics ``granularity`` and ``page_tokens`` say which was used."""
    slack = ctx.case.params.slack_bytes
    ctx = up_to_undeclared_op(ctx)  # shares metrics with the caller's context
    shapes = _shapes_for(ctx)
    cache = ctx.new_cache()
    raw: list[tuple[Checkpoint, list]] = []
    capacities: dict = {}

    def measure(label, tokens, after_reset):
        layers = dict(cache_layers(cache))
        held, shared = cache_bytes(cache, exclude=owned_by_model(ctx.model.model))
        raw.append((Checkpoint(label, tokens, after_reset, reported=_reported_length(cache), shared=shared),
                    [(name, held[name], layer, tokens) for name, layer in layers.items()]))
        for name, layer in layers.items():
            capacities.setdefault(name, []).append((tokens, buffer_tokens(layer)))

    probe = GrowthProbe()
    try:
        run_memory_ops(ctx, cache, measure, observers=[probe])
    except SubjectRaised as exc:  # a batch it cannot run: measured at batch 1 as well (measured_at_batch_one)
        measured_at_batch_one(
            ctx, exc, check_memory_bytes,
            lambda c, e: fail_raised(c, e, "the cache does not support this sequence of calls (see the exception)"),
            lambda m: f"{_mib(m.get('bytes_held', 0))} held vs {_mib(m.get('bytes_formula', 0))} by the formula "
                      f"({m.get('ratio')}×) after S={m.get('tokens')} tokens")
    if not raw:
        raise ValueError(f"case {ctx.case.id}: no token-feeding op, nothing to measure")
    grains = granularities(ctx.subject, probe.rows, shapes)  # with SHARED: the pool's pages (declared or inferred)
    if any(cp.shared for cp, _ in raw) and SHARED not in grains and len({g.tokens for g in grains.values()}) == 1:
        grains[SHARED] = next(iter(grains.values()))  # no forward saw the pool grow: its layers' allocation rule
    policies = allocations(ctx.subject, raw, probe.rows, shapes, slack, capacities)
    checkpoints = _expected_at_checkpoints(ctx, cache, raw, shapes, slack, grains, policies)
    page_tokens = sorted({g.tokens for g in grains.values() if g.tokens > 1})
    last = checkpoints[-1]
    peak = max(checkpoints, key=lambda c: c.held)
    ctx.metrics.update(_checkpoint_metrics(last), peak_bytes=peak.held,
                       layers=len([name for name, _, _ in last.layers if name != SHARED]),
                       per_op=[[c.op, c.tokens, c.held, c.formula] for c in checkpoints],
                       granularity=granularity_summary(grains),
                       allocation=sorted({p.describe() for p in policies.values() if p.policy}) or None,
                       page_tokens=page_tokens[0] if len(page_tokens) == 1 else (page_tokens or 1))
    # what was measured: the first checkpoint that counted no byte while tokens are held (blind), else the last
    empty = next((cp for cp in checkpoints if cp.tokens and not cp.held), last)
    ctx.measured.record(bytes_held=empty.held, tokens_held=empty.tokens)
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
    grain = grains.get(label, TOKEN_BY_TOKEN)
    policy = policies.get(label, NO_POLICY)
    shape = shapes.get(label)
    hint = _allocation_hint(raw, capacities, label, shape, exp, excess, policy, grain)
    ctx.fail([
        observed + f" ({ratio:.2f}× the formula)",
        f"formula: {exp.formula}" + ("" if exp.lossy else f" (+ slack {slack} B)"),
        f"granularity of {label}: {grain.describe()}" + (f"; allocation: {policy.describe()}" if policy.policy
                                                         else ""),
        f"whole cache: {_mib(cp.held)} held vs {_mib(cp.formula)} by the formula after S={cp.tokens} tokens",
        f"{label} held/formula after each op: {per_op}",
        hint,
        f"ops: {_ops_label(ctx, cp.op + (' after the reset' if cp.after_reset else ''))}",
        "likely cause: " + (_length_cause(checkpoints) or _ignores_max_cache_len(exp, held, label) or
                            _policy_cause(policy, label, checkpoints) or
                            (_ahead_of_need(raw, capacities, label, shape, slack) if grain.tokens <= 1 else None) or
                            _beyond_capacity(raw, label, shape, slack) or
                            _memory_cause(exp, excess, shapes, label, checkpoints, grain, probe.rows)),
    ], {"bytes_held": cp.held, "bytes_formula": cp.formula, "failed_at": cp.op, "layer": label,
        "layer_bytes": held, "layer_bound": exp.high if excess > 0 else exp.low,
        "layer_granularity": grain.describe()})


def _expected_at_checkpoints(ctx, cache, raw, shapes, slack, grains, policies) -> list:
    """The ``Checkpoint`` of each entry of ``raw`` (``[(checkpoint, [(layer name, bytes held, layer, tokens)])]``,
    as ``check_memory_bytes`` measured them) with each layer's ``Expectation`` appended: the formula of the
    reference's ``shapes`` at its granularity (``grains``) and allocation policy (``policies``), ``slack`` bytes
    above; a layer the reference does not have is expected to hold nothing."""
    checkpoints: list[Checkpoint] = []
    asked = {name: _asked(ctx, name) for name in shapes}  # the factory's signature read once, not per checkpoint
    for cp, layers in raw:
        for name, held, layer, tokens in layers:
            shape = shapes.get(name)
            if shape is None:  # a layer the reference does not have: everything it holds is unexplained
                why = layers_problem(cache) if name == "cache" else None
                cp.layers.append((name, held, Expectation(0, slack, "no such layer" if why is None else
                                                          f"no layer to compare: {why}, so the cache's bytes are "
                                                          f"counted as one block, which matches no layer of the "
                                                          f"reference (the Cache API's layers is a list of layer "
                                                          f"objects)", 0)))
                continue
            enc = ctx.model.encoder_states(ctx.case.encoder_len) if name.startswith("cross") else tokens
            cp.layers.append((name, held, expected_layer(shape, layer, enc, slack, grains[name].tokens,
                                                         policies[name].policy, asked[name])))
        if cp.shared:
            cp.layers.append((SHARED, cp.shared, _shared_expectation(cp.layers, slack)))
        checkpoints.append(cp)
    return checkpoints


def _asked(ctx, name: str) -> int | None:
    """The ``max_cache_len`` (tokens) the subject's layer ``name`` was built with, the most a bounded layer may
    declare and preallocate: the case's ``max_cache_len``; for a cross-attention layer of an encoder-decoder the
    larger of it and the encoder's states (kvconform builds that half with the encoder's length, a subject that
    returns its own ``EncoderDecoderCache`` builds it with the decoder's). None when the factory does not accept
    ``max_cache_len`` (``subjects.accepted_names``): a cache that was not asked sizes itself."""
    from kvconform.subjects import accepted_names

    names = accepted_names(ctx.subject.factory)
    if names is not None and "max_cache_len" not in names:
        return None
    if name.startswith("cross"):
        return max(ctx.max_cache_len, ctx.model.encoder_states(ctx.case.encoder_len))
    return ctx.max_cache_len


def _shared_expectation(layers: list, slack: int) -> Expectation:
    """What the cache object may own besides its layers (a pool they reach by a back-reference): what the layers'
    own holdings leave of their formulas (``exact``) and of their bounds (``high``, + ``slack``), summed over the
    layers — so the whole cache is held to the sum of its layers' bounds, each storage counted once."""
    exact = sum(max(e.exact - held, 0) for _, held, e in layers)
    high = sum(max(e.high - held, 0) for _, held, e in layers) + slack
    return Expectation(0, high, f"what its {len(layers)} layers leave of their formulas (Σ formula − bytes the layer "
                                f"holds itself = {exact:,} B; bound {high:,} B with the layers' page allowance and "
                                f"slack)", exact)


def _allocation_hint(raw, capacities, label, shape, exp, excess, policy, grain) -> str | None:
    """``"allocation: ..."``: why no allocation policy was inferred for layer ``label`` that holds ``excess`` bytes
    over its bound, where a policy could have explained it (token by token, exact, no window or preallocation in the
    formula, and ``_allocation.hint_applies`` to its series of holdings); None otherwise."""
    if (excess > 0 and not policy.policy and not exp.lossy and grain.tokens <= 1 and shape is not None
            and shape.token_bytes and "window=" not in exp.formula and "preallocated" not in exp.formula):
        series = [(tokens, h, layer) for c, layers in raw for name, h, layer, tokens in layers if name == label]
        if hint_applies(series, capacities.get(label, []), shape.token_bytes):
            return "allocation: " + not_inferred(series, capacities.get(label, []), shape.token_bytes)
    return None


def _reported_length(cache) -> int | None:
    """``cache.get_seq_length()`` as an int, or None when it raises or answers something else."""
    try:
        return int(cache.get_seq_length())
    except Exception:  # noqa: BLE001 - no length to read: no claim about it
        return None


def _length_cause(checkpoints) -> str | None:
    """The likely cause of bytes over the bound when the cache's own length was already wrong there: the first
    checkpoint whose ``get_seq_length()`` differs from the tokens held. After a ``reset()`` that kept its length
    the next sequence is stored after the old one's positions, so it takes the storage of both — the old pages
    may well have been freed. None when every checkpoint's length is right (or unreadable)."""
    right = [cp.reported == cp.tokens for cp in checkpoints]
    wrong = next((cp for cp, ok in zip(checkpoints, right) if cp.reported is not None and not ok), None)
    if wrong is None or not wrong.after_reset or wrong.reported <= wrong.tokens:
        return None
    if not all(ok for cp, ok in zip(checkpoints, right) if not cp.after_reset):
        return None  # a length that was never the tokens held (e.g. a state without a token count): no claim
    return (f"reset() does not reset the length: after reset() → {wrong.op} get_seq_length() = {wrong.reported} "
            f"where the cache should hold {wrong.tokens} tokens, so the new sequence is stored after the old "
            f"one's {wrong.reported - wrong.tokens} positions and the layer holds storage for both (the old "
            f"keys/values may well be freed) — reset() must set the length and any write offset back to 0")


def _ignores_max_cache_len(exp: Expectation, held: int, label: str) -> str | None:
    """The likely cause of a preallocating layer over its bound whose declared capacity exceeds the
    ``max_cache_len`` it was built with (``Expectation.over_asked``), or None."""
    if exp.over_asked is None:
        return None
    asked, declared = exp.over_asked
    return (f"the cache ignores the max_cache_len it was built with: asked for {asked} tokens, {label} declares a "
            f"capacity of {declared} (get_max_length()) and preallocates {held / max(exp.exact, 1):.1f}× what "
            f"{asked} slots take — size the buffers by the max_cache_len argument (rounded up to a page at most)")


def _policy_cause(policy: Allocation, label: str, checkpoints) -> str | None:
    """The likely cause of a layer over its bound under a declared or inferred allocation policy, or None."""
    if policy.policy == "preallocated":
        over = [(cp, held, e) for cp in checkpoints for name, held, e in cp.layers if name == label and held > e.high]
        cap = [e for _, _, e in over if "preallocated" in e.formula]
        if cap:
            cp, held, e = over[0]
            return (f"the preallocated buffer is larger than the layer's capacity "
                    f"({e.formula.split('max_cache_len=')[1].split(' ')[0]} "
                    f"tokens, get_max_length()): it holds {held / max(e.exact, 1):.1f}× what a ring of its window "
                    f"needs (slots allocated beyond what the layer ever reads)")
        return None
    if policy.policy != "doubling":
        return None
    if any("window=" in e.formula for cp in checkpoints for name, _, e in cp.layers if name == label):
        return None  # a bounded (sliding) layer: doubling does not apply to it, the general reading does
    series = [(cp, held, e) for cp in checkpoints for name, held, e in cp.layers if name == label]
    cropped = [i for i, (cp, _, _) in enumerate(series) if cp.op.startswith("crop") or cp.after_reset]
    over = [held > e.high for _, held, e in series]
    if cropped and any(over[cropped[0]:]) and not any(over[:cropped[0]]):
        return ("the doubling buffer is not shrunk by crop()/reset(): after them it holds more than twice the "
                "tokens left (halve the buffer when it is less than half full, free it on reset)")
    return ("the buffer grows by more than doubling (or allocates ahead of need): a doubling buffer holds at most "
            "twice the tokens fed")


def _beyond_capacity(raw: list, label: str, shape, slack: int) -> str | None:
    """The cause of a bounded layer (capacity ``C > 0``: ``get_max_length()``, an adapter's ``capacity``) that holds
    the same bytes after every op that left tokens in it, ``K`` tokens' bytes per row (± ``slack``) with ``K > C``:
    buffers preallocated for more tokens than the layer ever takes; else None."""
    from kvconform import compat

    if shape is None or not shape.token_bytes:
        return None
    series = [(tokens, held, layer) for _, layers in raw for name, held, layer, tokens in layers
              if name == label and tokens > 0]
    if not series or len({held for _, held, _ in series}) != 1:
        return None
    try:
        capacity = compat.max_length(series[0][2])
    except Exception:  # noqa: BLE001 - a layer that cannot say its capacity: no evidence
        return None
    held = series[0][1]
    slots = round(held / shape.token_bytes)
    if capacity <= 0 or slots <= capacity or abs(held - slots * shape.token_bytes) > slack:
        return None
    return (f"{_mib(held)} held after every op whatever the tokens (S = "
            f"{', '.join(str(t) for t, _, _ in series[:4])}...): buffers preallocated for {slots} tokens per row, "
            f"{slots / capacity:.2f}× the {capacity} tokens the cache says it takes (its capacity) — allocate the "
            f"capacity, not more")


def _ahead_of_need(raw: list, capacities: dict, label: str, shape, slack: int) -> str | None:
    """The cause of a layer over its formula whose keys are a view of a buffer of more than twice the tokens held
    and whose held bytes are that buffer's (``buffer_tokens``): slots allocated ahead of need; else None."""
    if shape is None or not shape.token_bytes:
        return None
    held = {tokens: h for c, layers in raw for name, h, _, tokens in layers if name == label}
    for tokens, slots in capacities.get(label, []):
        if slots and tokens and slots > 2 * tokens and abs(held.get(tokens, 0) - slots * shape.token_bytes) <= slack:
            return (f"the buffer behind its keys has {slots} slots for {tokens} tokens ({slots / tokens:.2f}×): "
                    f"it allocates ahead of need, beyond what amortised doubling (≤ 2× the tokens held) needs — "
                    f"grow to the next power of two of the tokens, not past it")
    return None


def _checkpoint_metrics(c) -> dict:
    """The JSON metrics of one memory checkpoint (bytes, tokens, ratios: all of the same step, ``measured_at``)."""
    return dict(measured_at=c.op, bytes_held=c.held, bytes_formula=c.formula, tokens=c.tokens,
                ratio=round(c.held / c.formula, 4) if c.formula else None, bytes_full_precision=c.full_precision,
                ratio_to_full_precision=round(c.held / c.full_precision, 4) if c.full_precision else None,
                **({"bytes_shared": c.shared} if c.shared else {}))


_PERMUTE_LABELS = frozenset(OPS[name].label_of(0) for name in op_names(rows="permute"))
"""How a checkpoint names the row permutations (``reorder``, ``swap_rows``, ``beam_fork``)."""


def _memory_cause(exp, excess, shapes, label, checkpoints, grain=TOKEN_BY_TOKEN, rows=()) -> str:
    """The likeliest cause, from how ``label``'s bytes relate to its formula over all checkpoints, its granularity
    ``grain`` and its growth at each forward (``rows``, ``GrowthProbe.rows``)."""
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
    token_bytes = shape.token_bytes if shape is not None else 0
    decode_growth = [row.held[label][1] - row.held[label][0] for row in rows
                     if label in row.held and row.n == 1 and row.start > 0]
    per_token = (token_bytes and decode_growth and len(set(decode_growth)) == 1
                 and decode_growth[0] >= 2 * token_bytes and decode_growth[0] % token_bytes == 0)
    if per_token and grain.tokens > 1 and decode_growth[0] == grain.tokens * token_bytes:
        return (f"a new page ({grain.tokens} tokens, {decode_growth[0]} B) is allocated for every token: the held "
                f"bytes grow by a whole page at every decode step, instead of once per {grain.tokens} tokens when "
                f"the last page is full")
    after_reset_over = any(cp.after_reset and held > e.high for cp in checkpoints for name, held, e in cp.layers
                           if name == label)
    before_reset_over = any(o for cp, o in zip(checkpoints, over) if not cp.after_reset)
    if grain.tokens > 1 and after_reset_over and not before_reset_over:
        return (f"pages are not freed by reset(): the pages ({grain.tokens} tokens each) of the sequence before "
                f"reset() are still held after it (superseded keys/values kept)")
    cropped = [i for i, cp in enumerate(checkpoints) if cp.op.startswith("crop")]
    if grain.tokens > 1 and cropped and any(over[cropped[0]:]) and not any(over[:cropped[0]]):
        return (f"pages are not freed by crop(): after crop the layer still holds the pages ({grain.tokens} tokens "
                f"each) past the new end; free every page beyond ceil(S/{grain.tokens})")
    reordered = [i for i, cp in enumerate(checkpoints) if cp.op in _PERMUTE_LABELS]
    if reordered and any(over[reordered[0]:]) and not any(over[:reordered[0]]):
        return (f"bytes grow at a reorder of the rows (beam search, after {checkpoints[reordered[0]].op}): what the "
                f"rows held before reorder_cache() is kept — the old rows' pages or buffers are copied for the new "
                f"rows but never freed")
    if ratios and all(over) and max(ratios) - min(ratios) < 0.05 and round(ratios[0]) >= 2:
        heads = f" (H_kv = {shape.dims[1]})" if shape is not None and shape.dims else ""
        page = (f", or a page of {round(ratios[0])} tokens allocated per token" if per_token
                and decode_growth[0] == round(ratios[0]) * token_bytes else "")
        return (f"a constant {round(ratios[0])}× the formula at every op: keys/values stored repeated across the "
                f"query heads (repeat_kv) or kept twice{heads}{page}")
    # an exact cache never holds less than full-precision keys/values can take: a ratio below 0.9 is compression
    # (asked before the shapes of excess below, which a falling ratio would otherwise mimic) — up to the first reorder
    # only: after beam search's reorders rows may share pages (copy-on-write), legitimately below the formula
    unshared = [(op, held, e) for op, held, e in series[:reordered[0] if reordered else None] if e.exact]
    if unshared and min(held / e.exact for _, held, e in unshared) < 0.9:
        low_op, low = min(((op, held / e.exact) for op, held, e in unshared), key=lambda p: p[1])
        return (f"held/formula falls from {max(ratios):.2f}× to {low:.2f}× (after {low_op}): at that "
                f"length the layer holds fewer bytes than full-precision keys/values can take, so it compresses or "
                f"drops them, with a fixed buffer on top that exceeds the formula at short lengths. A cache that "
                f"quantizes, compresses or evicts by design declares it (kvconform_lossy, kvconform_evicting or "
                f"kvconform_press) and is measured against its own formula")
    multi = [op.startswith(("prefill", "chunk")) for op, _, _ in series]
    if any(over) and all(m for m, o in zip(multi, over) if o) and not all(over):
        return ("over only right after a multi-token op, back within the formula after a decode step: the layer "
                "keeps a slice (a view) of the whole prefill/chunk buffer instead of a copy of its window")
    if grain.tokens > 1 and token_bytes:
        return (f"more than one spare page per row: the layer holds more than ceil(S/{grain.tokens}) + 1 pages of "
                f"{grain.tokens} tokens; pages are allocated ahead of need or never freed")
    # after reset() the layer starts again: over the formula there, by more than at the run's first op, means
    # bytes of the sequence before reset() are still held
    first_after = next((i for i, cp in enumerate(checkpoints) if cp.after_reset), None)
    carried = (first_after is not None and len(ratios) == len(checkpoints)
               and ratios[first_after] > ratios[0] + 0.05)
    if after_reset_over and (carried or not before_reset_over):
        return ("bytes survive reset(): superseded keys/values are kept somewhere reset() does not clear "
                "(a history list, a second buffer)")
    return ("the bytes grow faster than the tokens: superseded keys/values are kept (a history list, or views "
            "that pin old buffers)")


def _cuda_applies(subject, model, case, device="cpu"):
    from kvconform.compat import on_cuda

    if not on_cuda(device):
        return "requires CUDA (torch.cuda.memory_allocated; run with --kvconform-device cuda on a GPU)"
    return None


@register("memory", cost=1.5, needs=("forward",), applies=_cuda_applies, judges=(EXACT, LOSSY_TWIN),
          unjudged={LOSSY_FRESH: LOSSY_BYTES}, ops=OpRule(allowed=MEMORY_OPS, min_forwards=1), params={
    "cuda_slack_bytes": Param(int, default=1 << 20, min=0, doc="bytes allowed above the counted bytes")})
def check_memory_cuda_allocated(ctx):
    """On CUDA: the allocator's view agrees with the counted bytes — ``memory_allocated`` after the ops minus before
    (outputs dropped) is within ``slack`` of ``held_bytes(cache)``, so nothing is held where attribute traversal
    cannot see it (closures, globals, class attributes); the peak (``max_memory_allocated``) is reported. The window
    opens after a warm-up request (the same ops on a fresh cache, dropped): cuBLAS allocates its workspace per
    stream on the first matmul through the caching allocator, where ``memory_allocated`` counts it (MiBs, above
    any slack), and it stays allocated."""
    import gc

    import torch

    device = next(ctx.model.model.parameters()).device
    slack = ctx.case.params.cuda_slack_bytes
    warm = ctx.new_cache()
    try:
        run_memory_ops(ctx, warm, lambda *_: None)
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache does not support this sequence of calls (see the exception)")
    del warm
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
    if subject.same_as is None:
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


def live_tensor_bytes(exclude=frozenset()) -> int:
    """Bytes of every distinct tensor storage reachable as a live Python ``torch.Tensor`` (``gc.get_objects()``,
    after ``gc.collect()``; objects frozen by ``gc.freeze()`` are not walked), on any device: what a process keeps,
    wherever it is referenced from (a class-level or module-level pool, a closure, a global list) — attribute
    traversal of the cache cannot see those. Storages whose key (``_measure.storage_key``) is in ``exclude`` are not
    counted (the model's own: ``_measure.owned_by_model``)."""
    import gc

    import torch

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that reads __class__, which some lazy module objects answer with a warning
        if issubclass(kind, torch.Tensor) and not issubclass(kind, torch.nn.Parameter):
            try:
                storage = obj.untyped_storage()
                if storage.data_ptr() == 0:
                    continue
            except Exception:  # noqa: BLE001 - a tensor subclass without a plain storage (meta, sparse ...)
                continue
            key, size = storage_key(obj)
            if key not in seen and key not in exclude:
                seen.add(key)
                total += size
    return total


@register("memory", cost=1.5, needs=("forward",), ops=OpRule(allowed=MEMORY_OPS, min_forwards=1), params={
    "requests": Param(int, default=3, min=2, doc="requests served after the warm-up, each with a fresh cache"),
    "slack_bytes": Param(int, default=16384, min=0, doc="live tensor bytes allowed to remain after the requests")})
def check_memory_released(ctx):
    """Memory a cache keeps after it is released: a warm-up request (a fresh cache, the case's ops, dropped), then
    ``params.requests`` more, each with a fresh cache that is dropped afterwards; the bytes of live tensors in the
    process (``live_tensor_bytes``, CPU and GPU alike) after the last must be within ``slack_bytes`` of the bytes
    after the warm-up. A host-side pool that grows with every request fails; the memory family's formula checks
    see only what the live cache object holds."""
    held: list = []  # (tokens, bytes) the cache owned at the end of each request: what was measured

    def request():
        cache = ctx.new_cache()
        try:
            run_memory_ops(ctx, cache, lambda *_: None)
        except SubjectRaised as exc:
            fail_raised(ctx, exc, "the cache does not support this sequence of calls (see the exception)")
        per_layer, shared = cache_bytes(cache, exclude=owned_by_model(ctx.model.model))
        held.append(((ops_tokens_held(ctx.case.ops) or [0])[-1], sum(per_layer.values()) + shared))
        del cache

    import gc

    requests = ctx.case.params.requests
    slack = ctx.case.params.slack_bytes
    request()
    # Every object the collector tracks after the warm-up is frozen (gc.freeze: moved out of its generations until
    # gc.unfreeze), so that live_tensor_bytes walks only what the later requests created instead of the whole heap
    # (~450,000 objects with a model loaded: 0.75 s a walk, 4 walks an item). What those requests leave alive is what
    # grew; a tensor of the warm-up freed later no longer lowers the count, which a growth check does not need.
    # No gc.collect() first: a full collection of that heap took ~85 ms an item, and the warm-up's uncollected
    # cycles, frozen with the rest, are never walked either; they are collected after gc.unfreeze.
    gc.freeze()
    try:
        base = live_tensor_bytes()
        after = []
        for _ in range(requests):
            request()
            # the model's own tensors are not the cache's: a from-scratch model whose setup call (new_cache) rebuilds
            # its rotary table keeps one table, a new one after every request
            after.append(live_tensor_bytes(exclude=owned_by_model(ctx.model.model)) - base)
    finally:
        gc.unfreeze()
    tokens, owned = held[-1]
    ctx.metrics.update(kept_bytes=after[-1], kept_per_request=after, slack_bytes=slack, bytes_held=owned)
    ctx.measured.record(bytes_held=owned, tokens_held=tokens)
    if after[-1] > slack:
        ctx.fail([
            f"after {requests} requests, each with a fresh cache dropped at its end, {_mib(after[-1])} more of live "
            f"tensors remain than after the warm-up (slack {_mib(slack)}): "
            + ", ".join(_mib(a) for a in after) + " after each",
            f"ops per request: {ctx.case.ops_label()}",
            "likely cause: the cache keeps tensors alive after it is released — a pool, list or dict at class or "
            "module level (or in a closure) that grows with every request and is never emptied or reused",
        ], {"kept_bytes": after[-1], "failed_at": f"request {requests}"})


@register("memory", cost=1.5, needs=("forward",), applies=_offloaded_row,
          ops=OpRule(allowed=FORWARD_OPS, first="prefill"),
          params={"layers": Param(int, default=6, min=1, doc="decoder layers of the model copy")},
          transformers_only="transformers' offloaded caches")
def check_offloaded_matches(ctx):
    """An offloaded subject (CUDA) decodes to the logits of the non-offloaded subject it names (``same_as``) and
    allocates less GPU memory at its decode peak, on a deeper copy of the model (``params.layers``, default 6) so
    that offloading has layers to move."""
    import dataclasses

    import torch

    from kvconform.subjects import builtin_subjects

    baseline = next((s for s in builtin_subjects() if s.name == ctx.subject.same_as), None)
    if baseline is None:
        raise ValueError(f"{ctx.subject.name}: same_as names no built-in subject ({ctx.subject.same_as!r})")
    if not torch.cuda.is_available():  # the session's rule skips this item; a direct call must not pass
        raise RuntimeError("offloading needs CUDA")
    model = _deeper(ctx.model, ctx.case.params.layers)
    dctx = ctx.replace(model=dataclasses.replace(ctx.model, model=model, config=model.config))
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
