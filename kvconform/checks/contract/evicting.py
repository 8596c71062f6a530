"""The evicting contract of family ``contract`` (``kind="evicting"``, ``Budget.tokens_max``): what holds exactly,
whatever an evicting cache evicted (``check_evicting_bounds``, ``check_evicting_crop``, ``check_evicting_ops``).
"""

from __future__ import annotations

import copy

from kvconform import compat
from kvconform.checks import EVICTING, IGNORES_OPS, CheckSkipped, Param, register
from kvconform.checks._diagnosis import describe_exception, fail_raised
from kvconform.checks._drive import (SubjectRaised, case_generator, encoder_ids_for, image_prompt,
                                     random_tokens, seq_length)
from kvconform.checks._measure import layer_items, read_attr, self_half
from kvconform.checks._interpreter import Runner
from kvconform.subjects import kind_of
from kvconform.checks._refusal import CROP_WORDS, changed, clear_error, snapshot
from kvconform.ops import OP_CAPABILITY
from kvconform.oracle import compare_logits


# ================================================================================= the evicting contract
# The contract of an *evicting* cache (``kind="evicting"``, ``Budget.tokens_max``), checked past ``tokens_max``
# (family ``contract``; see docs/lossy-evicting-paged.md, "Evicting caches").
#
# An evicting cache drops tokens (attention sinks + window, KV presses). Below ``tokens_max`` held tokens it is exact,
# so the exact families' cases that stay below apply to it unchanged (``Kind.not_judged`` skips the
# others). Past ``tokens_max`` its logits are judged by quality and its memory bound (family ``quality``); what holds
# exactly whatever it evicted is checked here:
#
# * ``check_evicting_bounds``: a prefill longer than ``tokens_max`` into an empty cache is exact (eviction comes
#   *after* the forward that brings the tokens: ``update`` returns every held token and the whole new chunk); after
#   every forward ``get_seq_length()`` is the number of tokens seen (the next position), not the number held; and
#   each attention layer holds at most ``tokens_max`` tokens per row (decode steps and a chunk longer than the window
#   included).
# * ``check_evicting_crop``: after eviction, ``crop(-k)`` either leaves the cache exactly as if it had never seen the
#   last ``k`` tokens (the next logits equal those of a fresh instance fed only the rest), or is refused with a clear
#   error and changes nothing.
# * ``check_evicting_ops``: after eviction, ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``
#   / ``reset`` / ``copy.deepcopy`` behave as for any cache: the next logits equal those of a fresh instance of the
#   same class fed the equivalent history (the rows permuted, selected or repeated; a new sequence; the same one),
#   forward for forward — exact wherever the class is deterministic, however much it evicted.
#
# Each check builds its own program from the subject's ``tokens_max`` (``T``): ``prefill(T + over)``, then decode
# steps and a chunk longer than ``T``; ``params.over`` (default 5) sets how far past ``T`` the prefill goes.


EVICTING_ONLY = "applies to evicting subjects only (kind='evicting' with a tokens_max or keep_ratio budget)"
"""The skip reason of the evicting contract's checks (``judges=(EVICTING,)``) on every other kind."""


def held_tokens(cache) -> dict:
    """``{layer index: tokens held per row}`` of every attention layer of ``cache`` (its self-attention half for
    an ``EncoderDecoderCache``) whose keys are a ``[batch, heads, tokens, head_dim]`` tensor named ``keys``;
    layers without such a tensor (linear-attention states, other storage) are left out."""
    import torch

    out = {}
    for i, layer in layer_items(self_half(cache)):
        keys = read_attr(layer, "keys")
        if isinstance(keys, torch.Tensor) and keys.dim() == 4:
            out[i] = int(keys.shape[-2])
    return out


_PARAMS = {"over": Param(int, default=5, min=1, doc="tokens past tokens_max of the first prefill")}


class _Driver:
    """One cache of the subject fed seeded tokens through the interpreter (``Runner.feed``: the one place that feeds
    a cache), with the sequence it was fed (``seq`` ``[B, T]``; a check that applies an op itself sets ``seq`` to
    what the cache should hold after it)."""

    def __init__(self, ctx, cache, encoder_ids):
        self.runner = Runner(ctx, cache, position_mode="auto", padding=[])
        self.runner.encoder_ids = encoder_ids

    @property
    def cache(self):
        """The cache being fed."""
        return self.runner.cache

    @cache.setter
    def cache(self, cache):
        self.runner.cache = cache

    @property
    def encoder_ids(self):
        """The encoder input ``[B, E]`` (None for decoder-only models)."""
        return self.runner.encoder_ids

    @encoder_ids.setter
    def encoder_ids(self, encoder_ids):
        self.runner.encoder_ids = encoder_ids

    @property
    def seq(self):
        """The tokens the cache should hold, ``[B, T]`` int64."""
        return self.runner.seq

    @seq.setter
    def seq(self, seq):
        self.runner.seq, self.runner.batch = seq, int(seq.shape[0])
        self.runner._cut_chunks(int(seq.shape[1]))

    def feed(self, tokens, label):
        """One forward of ``tokens`` ``[B, n]``; returns float64 logits ``[B, n, V]``.

        Raises:
            SubjectRaised: the subject raised (names ``label``).
        """
        if self.runner.length == 0:
            self.seq = tokens[:, :0]
        return self.runner.feed(int(tokens.shape[1]), label, tokens=tokens).logits


def _tokens(ctx, gen, batch, n, prompt: bool = False):
    """``[batch, n]`` seeded tokens; ``prompt``: the first tokens of a sequence, which on a VLM start with its image
    (``image_prompt``; a prompt too short for the image block stays text)."""
    tokens = random_tokens(gen, batch, n, ctx.model.vocab_size)
    return image_prompt(ctx.model, tokens) if prompt else tokens


SHARE_PAST = 12
"""How far past ``tokens_exact`` the programs of a share-evicting subject (``keep_ratio``) go at least, so that it
has evicted before the op under test."""


def _tokens_max(ctx) -> int:
    """``T`` of the evicting programs: ``tokens_max``, or for a subject evicting a share (``keep_ratio``) its
    ``tokens_exact`` + ``SHARE_PAST`` (it evicts from ``tokens_exact`` on)."""
    kind = kind_of(ctx.subject)
    if kind.keep_ratio is not None:
        return int(kind.exact_limit or 0) + SHARE_PAST
    return int(ctx.subject.budget.tokens_max)


def _max_abs(a, b) -> float:
    return float((a - b).abs().max())


# ------------------------------------------------------------------------------------------ bounds and length
@register("contract", needs=("forward",), judges=(EVICTING,), unjudged=EVICTING_ONLY, params=_PARAMS, ops=IGNORES_OPS)
def check_evicting_bounds(ctx):
    """Past ``tokens_max``: the forward that brings the cache past it is exact, ``get_seq_length()`` counts the
    tokens seen, and each attention layer holds at most ``tokens_max`` tokens per row after every forward."""
    T, over = _tokens_max(ctx), ctx.case.params.over
    gen = case_generator(ctx.case, ctx.model.name)
    enc = encoder_ids_for(ctx, gen)
    B = ctx.case.batch
    kind = kind_of(ctx.subject)
    # a share: exact while ≤ tokens_exact seen
    exact_upto = (kind.exact_limit or 0) if kind.keep_ratio is not None else 0
    program = [("prefill", T + over), ("decode", 3), ("chunk", T + 3), ("decode", 2)]
    if exact_upto:  # below tokens_exact first, one token at a time, then the forward that crosses it
        first = max(exact_upto - 2, 1)
        program = [("prefill", first), ("decode", exact_upto - first), ("chunk", T + over - exact_upto),
                   ("decode", 3), ("chunk", T + 3), ("decode", 2)]
    ops_text = " → ".join(f"{name}({n})" if name != "decode" else f"decode×{n}" for name, n in program)
    run = _Driver(ctx, ctx.new_cache(), enc)
    tol = ctx.tolerance()
    worst_held = 0
    try:
        for name, n in program:
            for i in range(n if name == "decode" else 1):
                k = 1 if name == "decode" else n
                label = f"{name}({n})" if name != "decode" else f"decode {i + 1} of {n}"
                before = run.runner.length
                logits = run.feed(_tokens(ctx, gen, B, k, prompt=name == "prefill"), label)
                if name == "prefill" or before <= exact_upto:
                    _judge_exact(ctx, run, logits, tol, label, ops_text, before)
                _judge_bounds(ctx, run, label, ops_text, T)
                worst_held = max([worst_held, *held_tokens(run.cache).values()])
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache does not take a sequence longer than its tokens_max (see the exception)",
                    ops_text)
    ctx.metrics.update(tokens_max=T, tokens_fed=int(run.seq.shape[1]), most_held=worst_held,
                       held_readable=bool(held_tokens(run.cache)))


def _judge_exact(ctx, run, logits, tol, label, ops_text, before: int = 0):
    """The forward that fed the cache from ``before`` tokens (its ``logits`` ``[B, n, V]``) against the oracle;
    ``before > 0`` only for a share-evicting subject below its ``tokens_exact``, where nothing may have been
    evicted yet."""

    n = logits.shape[1]
    oracle = ctx.oracle.logits(run.seq, encoder_ids=run.encoder_ids)[:, -n:]
    uncached = ctx.oracle.uncached(run.seq, encoder_ids=run.encoder_ids)[:, -n:]
    cmp = compare_logits(logits, oracle, uncached, tol)
    ctx.metrics.update(max_abs=cmp.max_abs, tolerance=cmp.tol, noise_floor=cmp.floor)
    if cmp.passed:
        return
    if before:
        kind = kind_of(ctx.subject)
        ctx.fail([
            f"{label} after {before} tokens: max|Δlogit| = {cmp.max_abs:.1e} against the oracle, but should be ≤ "
            f"{cmp.tol:.1e} ({tol.describe(cmp.floor)}): the cache declares it evicts nothing before "
            f"{kind.exact_limit} tokens seen (tokens_exact)",
            f"ops: {ops_text}   [failed at {label}]",
            f"likely cause: the cache evicts (or changes what it holds) before tokens_exact = {kind.exact_limit} "
            f"tokens: it holds {', '.join(str(v) for v in held_tokens(run.cache).values()) or '?'} tokens per row "
            f"after {run.runner.length} seen — declare the tokens_exact it keeps, or keep every token up to it",
        ], {"failed_at": label, "tokens_exact": kind.exact_limit})
    ctx.fail([
        f"{label} into an empty cache: max|Δlogit| = {cmp.max_abs:.1e} against the oracle, but should be ≤ "
        f"{cmp.tol:.1e} ({tol.describe(cmp.floor)})",
        f"ops: {ops_text}   [failed at {label}]",
        f"likely cause: the cache evicts inside the forward that brings the tokens (its own chunk): a forward must "
        f"attend every token held before it plus its whole chunk — update() returns them all and announces them "
        f"in get_mask_sizes() — and evict only afterwards (tokens_max {_tokens_max(ctx)})",
    ], {"failed_at": label})


def _judge_bounds(ctx, run, label, ops_text, T):
    fed = int(run.seq.shape[1])
    reported = seq_length(run.cache)
    held = held_tokens(run.cache)
    if reported is not None and reported != fed:
        most = max(held.values(), default=None)
        restart = (f"get_seq_length() reports the tokens held ({most}), not the tokens seen: after an eviction "
                   f"the next token gets position {reported} instead of {fed} (positions restart: RoPE and absolute "
                   f"positions go wrong)") if reported == most else (
                   "get_seq_length() must count every token seen since the last reset (the next token's position), "
                   "whatever was evicted")
        ctx.fail([f"get_seq_length() = {reported} after {label}, but should be {fed} (tokens seen)",
                  f"ops: {ops_text}   [failed at {label}]", f"likely cause: {restart}"],
                 {"reported": reported, "tokens_fed": fed, "failed_at": label})
    kind = kind_of(ctx.subject)
    bound = kind.held_bound(fed) if kind.keep_ratio is not None else T
    over = {i: n for i, n in held.items() if n > bound}
    if over:
        i, n = next(iter(over.items()))
        if kind.keep_ratio is not None:
            declared = ctx.subject.budget.describe_bound()
            ctx.fail([f"attention layer {i} holds {n} tokens per row after {label} ({fed} seen), but should hold ≤ "
                      f"{bound} ({declared})" + (f" (layers over it: {sorted(over)})" if len(over) > 1 else ""),
                      f"ops: {ops_text}   [failed at {label}]",
                      f"likely cause: the cache keeps a larger share than it declares ({n / max(fed, 1):.2f} of the "
                      f"{fed} tokens seen; declared keep_ratio {kind.keep_ratio:g} past "
                      f"{kind.exact_limit} tokens), or does not evict at every step"],
                     {"held": n, "layer": i, "held_bound": bound, "failed_at": label})
        ctx.fail([f"attention layer {i} holds {n} tokens per row after {label} ({fed} seen), but tokens_max is {T}"
                  + (f" (layers over it: {sorted(over)})" if len(over) > 1 else ""),
                  f"ops: {ops_text}   [failed at {label}]",
                  "likely cause: the cache does not evict (or evicts too little): what it holds grows with the "
                  "sequence, so its memory is not bounded by the declared tokens_max"],
                 {"held": n, "layer": i, "tokens_max": T, "failed_at": label})


# ------------------------------------------------------------------------------------------ crop
@register("contract", needs=("forward", "crop"), judges=(EVICTING,), unjudged=EVICTING_ONLY, params={
    **_PARAMS, "crop": Param(int, default=2, min=1, doc="tokens the crop removes after the eviction")},
    ops=IGNORES_OPS)
def check_evicting_crop(ctx):
    """After eviction, ``crop(-k)`` leaves the cache exactly as a fresh instance fed all but the last ``k`` tokens
    (judged on the next step's logits), or is refused with a clear error that changes nothing."""

    T, over, k = _tokens_max(ctx), ctx.case.params.over, ctx.case.params.crop
    gen = case_generator(ctx.case, ctx.model.name)
    enc = encoder_ids_for(ctx, gen)
    B = ctx.case.batch
    prompt, nxt = _tokens(ctx, gen, B, T + over, prompt=True), _tokens(ctx, gen, B, 1)
    ops_text = f"prefill({T + over}) → crop(-{k}) → decode×1"
    tol = ctx.tolerance().bound(0.0)
    a = _Driver(ctx, ctx.new_cache(), enc)
    try:
        a.feed(prompt, f"prefill({T + over})")
        before = snapshot(a.cache)
        refused = None
        try:
            compat.crop(a.cache, k, T + over)
        except Exception as exc:  # noqa: BLE001 - judged below
            refused = exc
        if refused is not None:
            after = snapshot(a.cache)
            if not clear_error(refused, CROP_WORDS):
                ctx.fail([f"crop(-{k}) after eviction raised {describe_exception(refused)}",
                          f"ops: {ops_text}   [failed at crop(-{k})]",
                          "likely cause: a crop the cache cannot honour must be refused with a clear error (a "
                          "ValueError naming the problem), not a raw error from a tensor operation"],
                         {"raised": type(refused).__name__, "failed_at": f"crop(-{k})"})
            if changed(before, after):
                ctx.fail([f"crop(-{k}) after eviction was refused ({describe_exception(refused)}) but changed "
                          f"{', '.join(changed(before, after)[:4])}",
                          f"ops: {ops_text}   [failed at crop(-{k})]",
                          "likely cause: the refusal comes after part of the cache was cropped: check every layer "
                          "before changing any (all-or-nothing)"], {"failed_at": f"crop(-{k})"})
            target_prompt = prompt
        else:
            reported = seq_length(a.cache)
            if reported is not None and reported != T + over - k:
                ctx.fail([f"get_seq_length() = {reported} after crop(-{k}) of {T + over} tokens, but should be "
                          f"{T + over - k}", f"ops: {ops_text}   [failed at crop(-{k})]",
                          "likely cause: crop() must count back the tokens seen (the next token's position)"],
                         {"reported": reported, "failed_at": f"crop(-{k})"})
            a.seq = a.seq[:, : T + over - k]
            target_prompt = prompt[:, : T + over - k]
        got = a.feed(nxt, "decode 1 after crop")
        b = _Driver(ctx, ctx.new_cache(), enc)
        b.feed(target_prompt, f"prefill({target_prompt.shape[1]}) (fresh instance)")
        want = b.feed(nxt, "decode 1 (fresh instance)")
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache cannot continue after a crop past its eviction (see the exception)", ops_text)
    diff = _max_abs(got, want)
    ctx.metrics.update(max_abs=diff, tolerance=tol, crop_refused=refused is not None)
    if diff <= tol:
        return
    what = (f"refused ({type(refused).__name__}) and then" if refused is not None else "accepted, and")
    ctx.fail([f"crop(-{k}) after eviction was {what} the next logits differ from a fresh instance fed "
              f"{'all' if refused is not None else f'the first {T + over - k}'} of the tokens by {diff:.1e} "
              f"(should be ≤ {tol:.1e})",
              f"ops: {ops_text}   [failed at decode 1 after crop]",
              "likely cause: " + ("the refused crop still changed what the cache attends" if refused is not None
                                  else "the cache accepts a crop back past tokens it has already evicted: it cannot "
                                  "bring them back, so it must refuse such a crop (ValueError) — or not declare "
                                  "'crop'")],
             {"failed_at": "decode 1 after crop"})


# ------------------------------------------------------------------------------------------ batch ops, reset, fork
EVICTING_OPS = ("reorder", "select", "repeat", "reset", "fork")
"""The ops this check applies after an eviction (each one's capability: ``kvconform.ops.OP_CAPABILITY``)."""
_NEEDS = OP_CAPABILITY


@register("contract", needs=("forward",), judges=(EVICTING,), unjudged=EVICTING_ONLY, params={
    **_PARAMS, "op": Param(str, required=True, choices=EVICTING_OPS, doc="the op applied after the eviction")},
    ops=IGNORES_OPS)
def check_evicting_ops(ctx):
    """After eviction, ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` / ``reset`` /
    ``copy.deepcopy`` give the next logits of a fresh instance of the same class fed the equivalent history (the
    same forwards on the permuted / selected / repeated rows; a new sequence; the same sequence)."""
    import torch

    op = ctx.case.params.op
    if _NEEDS[op] not in ctx.subject.capabilities:
        raise CheckSkipped(f"{ctx.subject.name} does not declare capability '{_NEEDS[op]}'")
    T, over = _tokens_max(ctx), ctx.case.params.over
    gen = case_generator(ctx.case, ctx.model.name)
    B = ctx.case.batch
    enc = encoder_ids_for(ctx, gen)
    feeds = [_tokens(ctx, gen, B, T + over, prompt=True), *(_tokens(ctx, gen, B, 1) for _ in range(2))]
    rows = {"reorder": torch.roll(torch.arange(B), 1), "select": torch.arange(1, B) if B > 1 else torch.arange(1),
            "repeat": torch.arange(B).repeat_interleave(2)}.get(op)
    after = [_tokens(ctx, gen, B if rows is None else len(rows), 1) for _ in range(2)]
    ops_text = f"prefill({T + over}) → decode×2 → {op} → decode×2"
    label = op
    try:
        a = _Driver(ctx, ctx.new_cache(), enc)
        for i, t in enumerate(feeds):
            a.feed(t, f"prefill({T + over})" if i == 0 else f"decode {i}")
        cache, original = a.cache, None
        try:
            if op == "reorder":
                cache.reorder_cache(rows)
            elif op == "select":
                cache.batch_select_indices(rows)
            elif op == "repeat":
                cache.batch_repeat_interleave(2)
            elif op == "reset":
                cache.reset()
            else:
                original, a.cache = cache, copy.deepcopy(cache)
        except Exception as exc:  # noqa: BLE001 - the subject's failure
            raise SubjectRaised(op, exc) from exc
        a_enc = enc if enc is None or rows is None else enc[rows]
        a.encoder_ids = a_enc
        if op == "reset":
            a.seq = a.seq[:, :0]
            new = [_tokens(ctx, gen, B, T + over, prompt=True), *after]
        else:
            a.seq = a.seq if rows is None else a.seq[rows]
            new = after
        got = [a.feed(t, f"{'prefill' if (op == 'reset' and i == 0) else 'decode'} {i + 1} after {op}")
               for i, t in enumerate(new)]
        if original is not None:  # the original goes on too, and must not have been touched by the copy's steps
            o = _Driver(ctx, original, enc)
            o.seq = a.seq[:, : -len(new)]
            got_original = [o.feed(t, f"decode {i + 1} on the original after fork") for i, t in enumerate(new)]
        b = _Driver(ctx, ctx.new_cache(), a_enc)
        history = [] if op == "reset" else [t if rows is None else t[rows] for t in feeds]
        for i, t in enumerate(history):
            b.feed(t, f"{'prefill' if i == 0 else 'decode'} (fresh instance)")
        want = [b.feed(t, "fresh instance") for t in new]
    except SubjectRaised as exc:
        fail_raised(ctx, exc, f"the cache cannot {op} after it evicted (see the exception)", ops_text)
    tol = ctx.tolerance().bound(0.0)
    pairs = list(zip(got, want)) + (list(zip(got_original, want)) if original is not None else [])
    diffs = [_max_abs(g, w) for g, w in pairs]
    ctx.metrics.update(max_abs=max(diffs), tolerance=tol)
    if max(diffs) <= tol:
        return
    i = next(j for j, d in enumerate(diffs) if d > tol)
    where = f"decode {i % len(new) + 1} after {op}" + (" (on the original)" if i >= len(new) else "")
    cause = {"reorder": "reorder_cache() does not move every held tensor (sinks and window, per layer) with its row",
             "select": "batch_select_indices() does not select every held tensor (or the seen count) with the rows",
             "repeat": "batch_repeat_interleave() does not repeat every held tensor with the rows",
             "reset": "reset() keeps something of the old sequence (held tokens, the seen count, an eviction state)",
             "fork": "copy.deepcopy shares state between the copy and the original (one's steps change the other)"}
    ctx.fail([f"after {op}: max|Δlogit| = {diffs[i]:.1e} against a fresh instance of the same class fed the "
              f"equivalent history, but should be ≤ {tol:.1e}",
              f"ops: {ops_text}   [failed at {where}]", "likely cause: " + cause[op]],
             {"failed_at": where, "op": label})


# ------------------------------------------------------------------------------------------ exact past the bound
# An evicting cache that says which tokens it holds and at which positions (``kvconform_held(layer_idx)`` on the
# cache: ``(tokens, positions)``) is exact past its bound too, against StreamingLLM's own definition: the query of a
# step attends exactly the held tokens, whose keys carry the declared positions. The oracle is one uncached float64
# forward of the whole sequence with an explicit attention mask, each token's row holding what its own forward
# attended (the held tokens then, plus its own chunk up to itself): a held token's keys at every layer are the ones
# computed when it was fed, from its own row — a forward of only the held tokens would recompute them from a shorter
# history (1.1 off for a correct sink cache on llama). A held token declared at another position than its own (sinks
# re-rotated to sit before the window) is added as a copy at that position, together with the copies its own row
# needs (RoPE depends only on position differences, so a copy shifted as a block has the same hidden states).

HELD_LIMIT = 4096
"""The most tokens (the sequence and the copies at declared positions) of the held-token oracle's forward."""


def _held_applies(subject, model, case, device="cpu"):
    """Plan-time rule of ``check_evicting_held_exact``: decoder-only models whose layers are all full attention
    and whose forward takes ``position_ids``."""
    if model.is_encoder_decoder:
        return "the held-token oracle is one decoder forward; an encoder-decoder model's cross-attention is another"
    types = set(model.layer_types)
    if types - {"full_attention"}:
        return (f"the held-token oracle replaces the model's own mask, so it needs layers that are all full "
                f"attention ({model.name} has {', '.join(sorted(types - {'full_attention'}))})")
    if not model.accepts_position_ids:
        return f"{model.name}'s forward takes no position_ids counted from 0 (the held tokens' positions)"
    return None


def _rotary(torch_model) -> bool:
    """Whether a model embeds positions by rotating queries and keys (a module named ``*Rotary*``): only there is a
    block of tokens at shifted positions the same as at its own."""
    return any("rotary" in type(m).__name__.lower() for m in torch_model.modules())


def _declared_held(ctx, cache, seen: int, batch: int, label: str):
    """``{row: (tokens, positions)}`` (python lists) the next forward attends, read from every attention layer's
    ``kvconform_held``; checks the declaration (types, ranges, distinct tokens and positions, the same on every
    layer).

    Raises:
        CheckSkipped: layers declare different held sets (no one forward gives both), or none declares any.
        SubjectRaised: ``kvconform_held`` raised.
    """
    import torch

    declared = {}
    for i, _ in layer_items(self_half(cache)):
        try:
            got = cache.kvconform_held(i)
        except Exception as exc:  # noqa: BLE001 - the subject's failure
            raise SubjectRaised(f"kvconform_held({i}) before {label}", exc) from exc
        if got is None:
            continue
        ok = (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)
              and got[0].shape == got[1].shape and got[0].dim() in (1, 2)
              and (got[0].dim() == 1 or got[0].shape[0] == batch))
        if not ok:
            what = (", ".join(f"{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in got)
                    if isinstance(got, (tuple, list)) else type(got).__name__)
            ctx.fail([f"kvconform_held({i}) before {label} returned ({what}), but should return (tokens, positions): "
                      f"two int64 tensors of one shape, [n] (every row) or [{batch}, n]",
                      "likely cause: the declaration of the held tokens does not follow kvconform_held's protocol"],
                     {"failed_at": label})
        tokens, positions = (t.long().cpu().expand(batch, -1) for t in got)
        declared[i] = (tokens, positions)
    if not declared:
        raise CheckSkipped(f"{ctx.subject.name}.kvconform_held answers None for every layer: no held tokens to "
                           f"compare (judged by its quality budget)")
    first, (tokens, positions) = next(iter(declared.items()))
    for i, (t, p) in declared.items():
        if not (torch.equal(t, tokens) and torch.equal(p, positions)):
            raise CheckSkipped(f"layers {first} and {i} hold different tokens (or positions) before {label}: one "
                               f"uncached forward cannot attend both, so only the quality budget judges "
                               f"{ctx.subject.name} past its bound")
    out = {}
    for b in range(batch):
        t, p = tokens[b].tolist(), positions[b].tolist()
        problem = None
        if any(not 0 <= x < seen for x in t):
            problem = f"token indices {t} outside the {seen} tokens fed"
        elif len(set(t)) != len(t):
            problem = f"a token held twice: {sorted(x for x in set(t) if t.count(x) > 1)}"
        elif len(set(p)) != len(p):
            problem = (f"two held tokens at one position: {sorted(x for x in set(p) if p.count(x) > 1)} (positions "
                       f"{p[:8]}{' …' if len(p) > 8 else ''})")
        elif p and max(p) >= seen:
            problem = f"a held token at position {max(p)}, not before the next token's position {seen}"
        if problem:
            ctx.fail([f"kvconform_held({first}) before {label}, row {b}: {problem}",
                      "likely cause: the cache's held tokens (or the positions it rotates them to) are not a set of "
                      "distinct earlier tokens at distinct earlier positions, as StreamingLLM defines them"],
                     {"failed_at": label, "row": b})
        out[b] = (t, p)
    return out


def held_oracle_inputs(n_tokens: int, forwards, limit: int = HELD_LIMIT):
    """The inputs of the held-token oracle for one row: ``(order, allowed)`` — ``order`` the ``(token, position)``
    of each input slot (slot ``j < n_tokens`` is token ``j`` at its own position; copies at declared positions
    follow), ``allowed`` ``[L, L]`` bool (slot ``i`` attends slot ``j``); None when more than ``limit`` slots are
    needed.

    ``forwards``: ``(start, n, tokens, positions)`` per forward, in order: its ``n`` new tokens start at index
    ``start`` and attend the held ``tokens`` (lists) at ``positions``, then their own chunk up to themselves.
    """
    rows = {}
    for start, n, tokens, positions in forwards:
        held = list(zip(tokens, positions))
        for t in range(start, start + n):
            rows[(t, t)] = held + [(u, u) for u in range(start, t + 1)]
    order = [(j, j) for j in range(n_tokens)]
    slot = {node: j for j, node in enumerate(order)}
    queue = [key for node in order for key in rows[node]]
    while queue:
        node = queue.pop()
        if node in slot:
            continue
        token, position = node
        shift = position - token
        rows[node] = [(s, q + shift) for s, q in rows[(token, token)]]
        slot[node] = len(order)
        order.append(node)
        if len(order) > limit:
            return None
        queue.extend(rows[node])
    import torch

    allowed = torch.zeros(len(order), len(order), dtype=torch.bool)
    for node, j in slot.items():
        allowed[j, [slot[k] for k in rows[node]]] = True
    return order, allowed


def _held_oracle(ctx, seq_row, forwards):
    """float64 logits ``[n_tokens, V]`` of every token of ``seq_row`` ``[n_tokens]`` under the held-token oracle.

    Raises:
        CheckSkipped: the declared positions need copies on a model without rotary positions, or too many.
    """
    import torch

    n = int(seq_row.shape[0])
    model = ctx.model.oracle_model()
    built = held_oracle_inputs(n, forwards)
    if built is None:
        raise CheckSkipped(f"the declared positions need over {HELD_LIMIT} tokens in the held-token oracle")
    order, allowed = built
    if len(order) > n and not _rotary(model):
        raise CheckSkipped(f"{ctx.subject.name} declares held tokens at other positions than their own, and "
                           f"{ctx.model.name} has no rotary positions: a token cannot be moved in one forward")
    ids = seq_row[torch.tensor([t for t, _ in order])][None]
    positions = torch.tensor([p for _, p in order])[None]
    mask = torch.zeros(1, 1, *allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=ids.to(device), position_ids=positions.to(device), attention_mask=mask.to(device),
                    use_cache=False).logits
    return out[0, :n].detach().to("cpu", torch.float64)


@register("contract", needs=("forward",), judges=(EVICTING,), unjudged=EVICTING_ONLY, applies=_held_applies,
          params={**_PARAMS, "decode": Param(int, default=6, min=1, doc="decode steps after the prefill past the "
                                                                           "bound (a chunk of 3 and 2 more follow)")},
          ops=IGNORES_OPS)
def check_evicting_held_exact(ctx):
    """Past ``tokens_max``, a cache that declares what it holds (``kvconform_held(layer_idx)`` → ``(tokens,
    positions)``) gives at every step the logits of the model's uncached float64 forward in which each token
    attends exactly the held tokens at the declared positions (plus its own chunk); a cache that does not declare
    it is judged by its quality budget only (skipped here)."""
    held_fn = getattr(ctx.new_cache(), "kvconform_held", None)
    if not callable(held_fn):
        raise CheckSkipped(f"{ctx.subject.name} does not say which tokens it holds (no kvconform_held(layer_idx) "
                           f"method): past its bound it is judged by its quality budget only, which on the zoo's "
                           f"tiny random models cannot tell its eviction policy from a near one (a window one "
                           f"token off passes it) — declare kvconform_held to hold the code to its design")
    if ctx.model.image is not None:
        raise CheckSkipped("the held-token oracle moves text tokens only; a vision-language prompt starts with an "
                           "image")
    T, over, decode = _tokens_max(ctx), ctx.case.params.over, ctx.case.params.decode
    gen = case_generator(ctx.case, ctx.model.name)
    B = ctx.case.batch
    program = [("prefill", T + over), ("decode", decode), ("chunk", 3), ("decode", 2)]
    ops_text = " → ".join(f"{name}({n})" if name != "decode" else f"decode×{n}" for name, n in program)
    run = _Driver(ctx, ctx.new_cache(), None)
    forwards: dict = {b: [] for b in range(B)}
    steps = []
    try:
        for name, n in program:
            for i in range(n if name == "decode" else 1):
                k = 1 if name == "decode" else n
                label = f"{name}({n})" if name != "decode" else f"decode {i + 1} of {n}"
                seen = run.runner.length
                held = (_declared_held(ctx, run.cache, seen, B, label) if seen
                        else {b: ([], []) for b in range(B)})
                for b in range(B):
                    forwards[b].append((seen, k, *held[b]))
                steps.append((label, seen, k, run.feed(_tokens(ctx, gen, B, k), label),
                               max((len(t) for t, _ in held.values()), default=0)))
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache does not take this program past its tokens_max (see the exception)",
                    ops_text)
    oracle = [_held_oracle(ctx, run.seq[b], forwards[b]) for b in range(B)]
    tol = ctx.tolerance().bound(0.0)
    # the first forward's rows are plain causal: where the model does not honour an explicit 4-D mask (its own code
    # rebuilds the mask), they differ from the oracle, and no step can be judged this way
    first = int(steps[0][2])
    plain = ctx.oracle.logits(run.seq[:, :first])
    gap = max(_max_abs(oracle[b][:first], plain[b]) for b in range(B))
    if gap > tol:
        raise CheckSkipped(f"{ctx.model.name} does not honour an explicit 4-D attention mask (its causal rows differ "
                           f"from its uncached forward by {gap:.1e}): the held-token oracle cannot be built")
    worst = 0.0
    for index, (label, start, k, logits, n_held) in enumerate(steps):
        for b in range(B):
            diff = _max_abs(logits[b], oracle[b][start:start + k])
            worst = max(worst, diff)
            if diff > tol:
                tokens, positions = forwards[b][index][2:]
                shown = f"tokens {_span(tokens)} at positions {_span(positions)}"
                ctx.metrics.update(max_abs=diff, tolerance=tol, steps_compared=len(steps))
                ctx.fail([f"{label} (row {b}, {start} tokens seen, {n_held} held): max|Δlogit| = {diff:.1e} against "
                          f"the model's uncached float64 forward attending exactly the held tokens at the positions "
                          f"kvconform_held declares, but should be ≤ {tol:.1e}",
                          f"held: {shown}",
                          f"ops: {ops_text}   [failed at {label}]",
                          "likely cause: " + (
                              "the cache evicts inside the forward that brings the tokens (its own chunk): a "
                              "forward into an empty cache must attend all its tokens, and evict only afterwards"
                              if start == 0 else
                              "the keys the cache attends are not the declared tokens at the declared positions: "
                              "keys re-rotated by a wrong shift (e.g. sinks moved without subtracting the sink "
                              "count), positions that restart after an eviction, tokens kept other than the "
                              "declared ones, or a declaration that says something else than the cache does")],
                         {"failed_at": label, "row": b})
    ctx.metrics.update(max_abs=worst, tolerance=tol, steps_compared=len(steps),
                       most_held=max(s[4] for s in steps))


def _span(values) -> str:
    """A list of ints written as runs: ``0..3, 10..69``."""
    runs, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            runs.append(str(v) if start == v else f"{start}..{v}")
            start = None
    return "[" + ", ".join(runs) + "]"
