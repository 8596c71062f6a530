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
    T, over = _tokens_max(ctx), int(ctx.case.params["over"])
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

    T, over, k = _tokens_max(ctx), int(ctx.case.params["over"]), int(ctx.case.params["crop"])
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

    op = ctx.case.params["op"]
    if _NEEDS[op] not in ctx.subject.capabilities:
        raise CheckSkipped(f"{ctx.subject.name} does not declare capability '{_NEEDS[op]}'")
    T, over = _tokens_max(ctx), int(ctx.case.params["over"])
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
