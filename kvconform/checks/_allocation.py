"""The memory family's byte formula and allocation inference: what each layer must hold (``LayerShape`` measured on
``ReferenceCache``, ``expected_layer``) and how a cache allocates, read from the bytes it holds after each op.

A layer's granularity (``Granularity``: token by token, or pages of N tokens; ``infer_granularity``,
``granularities``) and its allocation policy (``Allocation``: preallocated, doubling, ...; ``infer_allocation``,
``allocations``), with the lines that say why a policy was not inferred (``not_inferred``, ``hint_applies``).
``checks/memory.py`` judges the bytes against the formula with them. Imports no other engine module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvconform import compat
from kvconform.checks._measure import (cache_bytes, cache_layers, held_bytes, owned_by_model, quant_params, read_attr,
                                       storage_bytes)

QUANT_BAND = 0.10


# ------------------------------------------------------------------------------------------------ the formula
def capacity_over_asked(capacity: int, asked: int | None, page: int = 1) -> int | None:
    """The capacity a bounded layer may take when it declares more than it was asked for: ``asked`` (the
    ``max_cache_len`` its factory was given, in tokens) rounded up to whole pages of ``page`` tokens, where the
    declared ``capacity`` (``get_max_length()``) exceeds that; None when it does not (or nothing was asked, or the
    layer is unbounded). A sliding window smaller than ``asked`` is within it."""
    if asked is None or asked <= 0 or capacity <= 0:
        return None
    allowed = -(-asked // max(page, 1)) * max(page, 1)
    return allowed if capacity > allowed else None


@dataclass
class LayerShape:
    """What one layer must hold, measured on the reference cache.

    Attributes:
        kind: ``"attention"``, ``"linear"`` or ``"hybrid"``.
        token_bytes: bytes of one token's keys + values over the batch (``B·H_kv·(D_k + D_v)·b``), 0 if none.
        dims: ``(B, H_kv, D, b)`` for the message (D of the keys).
        state_bytes: conv + recurrent state bytes (linear / hybrid layers), 0 if none.
        indexer_dim: ``D_idx`` of the per-token indexer keys an ``indexed_attention`` layer holds besides its keys
            and values (``[B, S, D_idx]``, counted in ``token_bytes``), 0 if none.
    """

    kind: str
    token_bytes: int = 0
    dims: tuple = ()
    state_bytes: int = 0
    indexer_dim: int = 0


def reference_shapes(ref_cache) -> dict[str, LayerShape]:
    """``{label: LayerShape}`` from a ``ReferenceCache`` (or ``EncoderDecoderCache`` of them) after a run."""
    out = {}
    for label, layer in cache_layers(ref_cache):
        dims: tuple[int, ...] = ()
        token_bytes, kv_bytes, indexer_dim = 0, 0, 0
        chunks = getattr(layer, "key_chunks", None)
        if chunks:
            k, v = chunks[0], layer.value_chunks[0]
            token_bytes = k.shape[0] * k.shape[1] * (k.shape[-1] + v.shape[-1]) * k.element_size()
            dims = (k.shape[0], k.shape[1], k.shape[-1], k.element_size())
            kv_bytes = storage_bytes(list(layer.key_chunks) + list(layer.value_chunks))
            indexer = list(getattr(layer, "indexer_chunks", None) or [])  # indexed_attention: per-token indexer keys
            if indexer:
                indexer_dim = indexer[0].shape[-1]
                token_bytes += indexer[0].shape[0] * indexer_dim * indexer[0].element_size()
                kv_bytes += storage_bytes(indexer)
        state_bytes = held_bytes(layer) - kv_bytes
        kind = "hybrid" if token_bytes and state_bytes else "attention" if token_bytes else "linear"
        out[label] = LayerShape(kind, token_bytes, dims, state_bytes, indexer_dim)
    return out


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
    over_asked: tuple[int, int] | None = None
    """``(asked, declared)`` tokens when a preallocating layer declares a capacity (``get_max_length()``) above the
    ``max_cache_len`` it was built with and the formula holds it to ``asked`` (``capacity_over_asked``); else None."""

    def __post_init__(self):
        self.full_precision = self.full_precision or self.exact


def expected_layer(shape: LayerShape, layer, tokens: int, slack: int, page: int = 1,
                   policy: str = "", asked: int | None = None) -> Expectation:
    """Expected bytes of subject ``layer`` holding ``tokens`` tokens (see the module docstring).

    ``page``: the layer's allocation granularity in tokens (``Granularity.tokens``); when > 1, an exact layer that
    does not preallocate may hold one page per row (``page · token_bytes``) above the formula. ``policy``
    (``Allocation.policy``): ``"preallocated"`` — a bounded layer (capacity > 0: a sliding window) holds its whole
    capacity from the first token on (a ring of the window); ``"doubling"`` — an exact layer may hold up to twice
    the tokens fed (amortised doubling buffers). ``asked``: the ``max_cache_len`` the layer was built with (None
    when the factory was not given one); a declared capacity above it — rounded up to whole pages — is held to it
    (``capacity_over_asked``): a cache asked for 64 slots that preallocates 4,096 is 64× over its formula."""
    state = shape.state_bytes
    if not shape.token_bytes:
        return Expectation(state, state + slack, f"conv+recurrent states {state} B (independent of S)", state)
    try:
        capacity = compat.max_length(layer)
    except Exception:  # noqa: BLE001 - an incomplete layer: treat as unbounded
        capacity = -1
    note = ""
    declared_len = read_attr(layer, "max_cache_len")
    if capacity < 0 and isinstance(declared_len, int) and declared_len > 0:
        # transformers 5.24: LinearAttentionAndStaticFullAttentionLayer (StaticCache on FalconH1) preallocates
        # max_cache_len but its get_max_length() resolves to the linear mixin's -1
        capacity, note = declared_len, "; get_max_length() says -1"
    bound = capacity_over_asked(capacity, asked, page)
    over_asked = None
    if bound is not None:
        note += f"; max_cache_len={bound} asked, get_max_length() says {capacity}"
        over_asked, capacity = (bound, capacity), bound
    compileable = read_attr(layer, "is_compileable", False) is True
    preallocates = (compileable or policy == "preallocated") and capacity > 0
    if preallocates and policy == "preallocated" and not compileable:
        note += "; a ring / buffer of its whole capacity, allocation preallocated"
    if capacity < 0:
        held, rule = tokens, f"S={tokens}"
    elif preallocates:
        held, rule = capacity, f"max_cache_len={capacity} (preallocated{note})"
    else:
        held, rule = min(tokens, capacity), f"min(S={tokens}, window={capacity})"
    B, H, D, b = shape.dims
    kv = held * shape.token_bytes
    per_token = f"2·B{B}·H_kv{H}·D{D}"
    if shape.indexer_dim:
        per_token = f"({per_token} + B{B}·D_idx{shape.indexer_dim})"
    text = f"{per_token}·{b}B · {rule} = {kv} B" + (f" + states {state} B" if state else "")
    q = quant_params(layer)
    if q is None:
        spare = page * shape.token_bytes if page > 1 and not preallocates else 0
        if spare:
            text += f" + one page per row ({page} tokens: {spare} B)"
        if policy == "doubling" and not preallocates and kv > spare:
            spare = kv
            text += f" + as much again (doubling buffers: ≤ 2× the {held} tokens held)"
        return Expectation(kv + state, kv + state + spare + slack, text, kv + state,
                           over_asked=over_asked if preallocates else None)
    nbits, group, residual = q
    ratio = quant_ratio(nbits, group, b)
    low = kv * ratio
    high = kv * ratio + min(residual, held) * shape.token_bytes * (1 - ratio)
    qtext = f"{nbits}-bit" + (f" group {group}" if group else "") + (f", residual {residual}" if residual else "")
    return Expectation(int(low * (1 - QUANT_BAND)) + state, int(high * (1 + QUANT_BAND)) + state + slack,
                       f"{qtext}: {ratio:.3f} × ({text})", int(low) + state, lossy=True, full_precision=kv + state)


# ------------------------------------------------------------------------------------------------ granularity
@dataclass(frozen=True)
class Granularity:
    """How a layer allocates: in pages of ``tokens`` tokens (1: token by token, no page), and where that comes from.

    Attributes:
        tokens: tokens per page (≥ 1).
        source: ``"declared"`` (the subject's ``page_size``), ``"inferred"`` (``infer_granularity``) or ``""``.
        evidence: for ``"inferred"``, the decode steps at which the bytes grew (message text).
    """

    tokens: int = 1
    source: str = ""
    evidence: str = ""

    def describe(self) -> str:
        """``"pages of 4 tokens, declared"`` / ``"pages of 4 tokens, inferred from growth at ..."`` / token by
        token."""
        if self.tokens <= 1:
            return "token by token (no page size declared, none inferred from the growth of the held bytes)"
        if self.source == "declared":
            return f"pages of {self.tokens} tokens, declared (page_size / kvconform_page_size)"
        return f"pages of {self.tokens} tokens, inferred from growth at {self.evidence}"


TOKEN_BY_TOKEN = Granularity()


@dataclass
class Growth:
    """One forward of a memory run: ``n`` new tokens from ``start``; ``held`` = ``{layer label: (bytes before,
    bytes after)}``."""

    label: str
    start: int
    n: int
    held: dict


class GrowthProbe:
    """Observer: the held bytes of every layer just before and just after each forward (``rows``: ``Growth``)."""

    def __init__(self):
        self.rows: list[Growth] = []
        self._before: dict = {}
        self._owned: frozenset | None = None

    def before_forward(self, runner, label, n):
        """Bytes of every layer before the forward."""
        if self._owned is None:  # the model's own storages, read once a run (its setup ran when the cache was made)
            self._owned = owned_by_model(runner.model.model)
        self._before = _held_by_label(runner.cache, self._owned)

    def after_forward(self, runner, step):
        """Bytes of every layer after the forward, paired with those before."""
        after = _held_by_label(runner.cache, self._owned or frozenset())
        self.rows.append(Growth(step.label, step.start, step.length,
                                {name: (self._before.get(name, 0), b) for name, b in after.items()}))


SHARED = "cache object (shared by its layers)"
"""The pseudo-layer of what a cache object owns that none of its layers holds itself (``_measure.cache_bytes``: a
page pool the layers reach by a back-reference)."""


def _held_by_label(cache, owned: frozenset) -> dict:
    """``{layer label: bytes}`` of ``cache``, plus ``SHARED`` where the cache object owns bytes no layer holds (the
    model's own storages, ``owned``, counted nowhere: ``owned_by_model``)."""
    per_layer, shared = cache_bytes(cache, exclude=owned)
    return {**per_layer, SHARED: shared} if shared else per_layer


def infer_granularity(rows: list, label: str, token_bytes: int) -> Granularity | None:
    """The page size of layer ``label`` from how its bytes grew over ``rows`` (``GrowthProbe.rows``):
    ``TOKEN_BY_TOKEN`` when its growth shows no pages, None when no decode step grew it at all (no evidence either
    way: a cross-attention layer filled once, a sliding layer at its window, a layer without keys/values).

    A layer is inferred to allocate pages of ``P ≥ 2`` tokens when, over the single-token forwards into a warm cache
    (decode steps), some allocate nothing and every one that grows grows by the same step ``G = P · token_bytes``,
    and every growth of the run (prefills and chunks too) is a multiple of ``G``. A cache that grows at every decode
    step (a page per token, a history list) never shows a flat step, so nothing is inferred for it.
    """
    if token_bytes <= 0:  # holds no keys/values (a linear-attention layer, an unused layer)
        return None
    deltas = [(row, row.held[label][1] - row.held[label][0]) for row in rows if label in row.held]
    decodes = [(row, d) for row, d in deltas if row.n == 1 and row.start > 0]
    grew = [(row, d) for row, d in decodes if d > 0]
    if not grew:
        return None
    if not any(d == 0 for _, d in decodes):
        return TOKEN_BY_TOKEN
    step = math.gcd(*[d for _, d in deltas if d > 0])
    if step % token_bytes or step // token_bytes < 2 or any(d != step for _, d in grew):
        return TOKEN_BY_TOKEN
    page = step // token_bytes
    at = ", ".join(f"S={row.start + 1}" for row, _ in grew)
    return Granularity(page, "inferred", f"decode steps {at} (+{page} tokens' bytes = {step} B each, no growth at "
                                         f"the other decode steps)")


def granularities(subject, rows: list, shapes: dict) -> dict:
    """``{layer label: Granularity}``: the subject's declared ``page_size`` for every layer, else each layer's
    ``infer_granularity``. A layer without evidence of its own (no decode step grew it) takes the page size the
    other layers of the cache agree on (one cache class allocates one way), named after the layer it was seen on;
    when they disagree or show none, it is ``TOKEN_BY_TOKEN``."""
    declared = subject.page_size
    pooled = any(SHARED in row.held for row in rows)
    if declared:
        return {label: Granularity(int(declared), "declared") for label in [*shapes, *([SHARED] if pooled else [])]}
    seen = {label: infer_granularity(rows, label, shape.token_bytes) for label, shape in shapes.items()}
    paged = {label: g for label, g in seen.items() if g is not None and g.tokens > 1}
    sizes = {g.tokens for g in seen.values() if g is not None}
    shared = None
    if paged and len(sizes) == 1:
        first, g = next(iter(paged.items()))
        shared = Granularity(g.tokens, "inferred", f"{g.evidence} on {first}")
    pool = None
    if pooled:  # a pool on the cache object grows by pages of every layer at once: P · Σ token_bytes a step
        pool = infer_granularity(rows, SHARED, sum(shape.token_bytes for shape in shapes.values()))
        if pool is not None and pool.tokens > 1:
            pool = Granularity(pool.tokens, "inferred", f"{pool.evidence} of the pool on the cache object")
            shared = shared or pool
    out = {label: g if g is not None else (shared or TOKEN_BY_TOKEN) for label, g in seen.items()}
    if pooled:
        out[SHARED] = pool if pool is not None and pool.tokens > 1 else (shared or TOKEN_BY_TOKEN)
    return out


@dataclass(frozen=True)
class Allocation:
    """How a layer allocates besides pages: ``policy`` ``""`` (token by token / pages), ``"preallocated"`` (its
    whole capacity from the first token: a ring of a sliding window) or ``"doubling"`` (amortised doubling
    buffers); ``source`` ``"declared"`` / ``"inferred"``; ``evidence`` for an inferred one."""

    policy: str = ""
    source: str = ""
    evidence: str = ""

    def describe(self) -> str:
        if not self.policy:
            return ""
        what = {"preallocated": "its capacity preallocated (one buffer of its capacity, or a ring of its window)",
                "doubling": "amortised doubling buffers (≤ 2× the tokens held)"}[self.policy]
        return what + (", declared (kvconform_allocation)" if self.source == "declared" else
                       f", inferred from {self.evidence}")


NO_POLICY = Allocation()


def buffer_tokens(layer) -> int | None:
    """The token slots of the buffer behind a layer's ``keys`` (``[B, H, T, D]``): its storage's bytes over one
    token's key bytes (``B·H·D·b``), when ``keys`` is a view of a larger buffer along the token axis (a buffer of
    capacity ``C > T`` that the cache fills in place); None when ``keys`` is not such a tensor or is its whole
    storage. What the cache itself reports of its capacity, read without calling it."""
    import torch

    try:
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[-2] == 0 or keys.numel() == 0:
            return None
        per_token = keys.numel() // keys.shape[-2] * keys.element_size()
        slots = keys.untyped_storage().nbytes() // per_token
    except Exception:  # noqa: BLE001 - a layer whose keys cannot be read: no evidence
        return None
    return int(slots) if slots > keys.shape[-2] else None


def infer_allocation(series: list, rows: list, label: str, token_bytes: int, slack: int,
                     capacities: list | None = None) -> Allocation:
    """The allocation policy of layer ``label`` from its held bytes: ``series`` ``[(tokens, held, layer)]`` after
    each op, ``rows`` the ``GrowthProbe`` forwards, ``capacities`` ``[(tokens, buffer slots or None)]`` after each
    op (``buffer_tokens``). ``preallocated`` when a bounded layer (``get_max_length() = C >
    0``) holds C tokens' bytes (± ``slack``) after every op that left tokens in it, fewer than C tokens included;
    ``doubling`` when every growth of a non-empty layer doubles its bytes and some decode steps grow nothing, or —
    when no growth was seen (one large prefill into a buffer that then had room for every decode step) — when after
    every op its keys are a view of a buffer of ``C`` slots with ``S < C ≤ 2·S`` (``S`` tokens held) and it holds
    those ``C`` slots' bytes (± ``slack``), no more. Else ``NO_POLICY``."""
    if token_bytes <= 0 or not series:
        return NO_POLICY
    try:
        capacity = compat.max_length(series[0][2])
    except Exception:  # noqa: BLE001 - an incomplete layer
        capacity = -1
    held = [(t, h) for t, h, _ in series if t > 0]
    if capacity > 0 and held and any(t < capacity - 1 for t, _ in held) and \
            all(abs(h - capacity * token_bytes) <= slack for _, h in held):
        return Allocation("preallocated", "inferred", f"{capacity} tokens' bytes held after every op (S = "
                                                      f"{', '.join(str(t) for t, _ in held[:4])}...)")
    deltas = [(row, row.held[label]) for row in rows if label in row.held]
    grew = [(row, b, a) for row, (b, a) in deltas if a > b > 0]
    flat = [row for row, (b, a) in deltas if a == b and row.n == 1 and row.start > 0]
    if grew and flat and all(abs(a - 2 * b) <= slack for _, b, a in grew):
        at = ", ".join(f"S={row.start + row.n} ({b} → {a} B)" for row, b, a in grew[:3])
        return Allocation("doubling", "inferred", f"the held bytes doubling at {at}, flat between")
    spare = _spare_capacity(series, capacities or [], token_bytes, slack)
    if spare:
        return Allocation("doubling", "inferred", spare)
    return NO_POLICY


def _spare_capacity(series: list, capacities: list, token_bytes: int, slack: int) -> str | None:
    """The evidence of a doubling buffer in what the cache reports (``infer_allocation``): after every op that left
    tokens, ``keys`` a view of ``C`` slots with ``S < C ≤ 2·S`` and the layer holding ``C`` slots' bytes; else None."""
    held = [(t, h) for t, h, _ in series if t > 0]
    slots = [c for t, c in capacities if t > 0]
    if not held or len(slots) != len(held) or any(c is None for c in slots):
        return None
    try:
        if compat.max_length(series[0][2]) > 0:
            return None  # a bounded (sliding) layer holds its window, not a growing buffer
    except Exception:  # noqa: BLE001 - an incomplete layer: no evidence
        return None
    for (t, h), c in zip(held, slots):
        if not t < c <= 2 * t or abs(h - c * token_bytes) > slack:
            return None
    shown = ", ".join(f"S={t} in {c} slots" for (t, _), c in list(zip(held, slots))[:3])
    return (f"the buffer its keys are a view of ({shown}: never more than twice the tokens held, and the held bytes "
            f"are those slots')")


def not_inferred(series: list, capacities: list, token_bytes: int) -> str:
    """Why ``doubling`` was not inferred for a layer that holds more than its formula (``infer_allocation``), as
    one line naming the declaration that would apply."""
    held = [(t, h) for t, h, _ in series if t > 0]
    slots = dict((t, c) for t, c in capacities if t > 0 and c is not None)
    worst = max((h / (t * token_bytes) for t, h in held if t and token_bytes), default=0.0)
    if slots:
        t, c = max(slots.items(), key=lambda tc: tc[1] / tc[0])
        why = (f"its keys are a view of a buffer of {c} slots for {t} tokens ({c / t:.2f}×)"
               + (", more than twice the tokens held" if c > 2 * t else
                  ", but it holds more bytes than those slots take"))
    else:
        why = ("no decode step showed the held bytes doubling and its keys are not a view of a larger buffer, so "
               "kvconform cannot see a buffer's capacity")
    if worst > 2.0 + 1e-9:
        return (f"no allocation policy declared, none inferred ({why}); it holds up to {worst:.2f}× the formula, "
                f"more than amortised doubling (≤ 2×) may hold, so no declared policy would explain it")
    return (f"no allocation policy declared, none inferred ({why}); it holds up to {worst:.2f}× the formula, which "
            f"a doubling buffer would explain — if the layer allocates amortised doubling buffers by design, declare "
            f"kvconform_allocation = \"doubling\" (CacheSpec allocation=\"doubling\")")


def hint_applies(series: list, capacities: list, token_bytes: int) -> bool:
    """Whether a failure of a layer with no allocation policy gets the ``not_inferred`` line: it holds at most
    twice its formula (a doubling buffer would explain it), or its keys are a view of a larger buffer."""
    worst = max((h / (t * token_bytes) for t, h, _ in series if t > 0 and token_bytes), default=0.0)
    return worst <= 2.0 + 1e-9 or any(c for t, c in capacities if t > 0)


def allocations(subject, raw: list, rows: list, shapes: dict, slack: int, capacities: dict | None = None) -> dict:
    """``{layer label: Allocation}``: the subject's declared ``allocation`` for every layer, else each layer's
    ``infer_allocation`` from ``raw`` (``[(Checkpoint, [(label, held, layer, tokens)])]``) and ``capacities``
    (``{label: [(tokens, buffer slots or None)]}`` after each op, ``buffer_tokens``)."""
    declared = subject.allocation
    if declared:
        return {label: Allocation(declared, "declared") for label in shapes}
    series: dict = {}
    for cp, layers in raw:
        for name, held, layer, tokens in layers:
            series.setdefault(name, []).append((tokens, held, layer))
    return {label: infer_allocation(series.get(label, []), rows, label, shape.token_bytes, slack,
                                    (capacities or {}).get(label))
            for label, shape in shapes.items()}


def granularity_summary(by_layer: dict) -> str:
    """One line for the metrics: the granularity of the token-holding layers (per layer when they differ)."""
    paged = {label: g for label, g in by_layer.items() if g.tokens > 1}
    if not paged:
        return TOKEN_BY_TOKEN.describe()
    first, g = next(iter(paged.items()))
    if len({x.tokens for x in paged.values()}) == 1 and len({x.source for x in paged.values()}) == 1:
        where = "" if g.source == "declared" else f" ({first}" + (f" and {len(paged) - 1} more" if len(paged) > 1
                                                                   else "") + ")"
        return g.describe() + where
    return "; ".join(f"{label}: {x.describe()}" for label, x in paged.items())
