"""Drive a model with a cache through a sequence of ops, the way real callers do, and compare every forward with
the oracle.

A ``Runner`` keeps the token sequence the cache is supposed to hold (``seq``, ``[B, T]`` int64), the attention mask
of a left-padded batch (``mask``, ``[B, T]`` int64, or None when nothing is padded) and, for encoder-decoder models,
the encoder input (``[B, E]``). Ops (DESIGN §2):

* ``prefill N`` / ``chunk N``: one forward of N new tokens (random, seeded, distinct per row). A prefill into an
  empty cache left-pads row ``b`` with ``padding[b]`` pad tokens (decoder-only models) when the case asks for it.
* ``decode N``: N single-token forwards.
* ``crop N``: ``cache.crop(-N)`` (through ``compat.crop``); the sequence loses its last N tokens (all of them when
  N is larger, the edge case a cache must handle by emptying itself or refusing clearly).
* ``fork``: ``copy.deepcopy(cache)``; the run continues on the copy and the original is *parked*: at the end every
  parked original gets one more decode step, which must still match the oracle of its own sequence.
* ``reorder``: ``cache.reorder_cache(perm)`` with a non-identity permutation (rows rolled by one).
* ``repeat R``: ``cache.batch_repeat_interleave(R)`` (rows ``[b0, b0, b1, b1, ...]``).
* ``select``: ``cache.batch_select_indices(idx)`` keeping every row but the first (the only row for batch 1).
* ``reset``: ``cache.reset()``; the next op starts a new sequence.

Every forward records a ``Step``. ``judge`` compares each step with the oracle logits of the sequence as it was at
that step (causality makes one oracle forward valid for every prefix); pad positions are not compared.
"""

from __future__ import annotations

import copy
import traceback
import zlib
from dataclasses import dataclass

from kvconform import compat
from kvconform.oracle import compare_logits, padded_position_ids

FIRST_TOKEN = 3  # ids 0..2 are pad / bos / eos in the zoo
PAD_TOKEN = 0


@dataclass
class Step:
    """One forward: ``logits`` float64 ``[B, length, V]`` for positions ``start .. start+length-1`` of ``seq``.

    ``seq`` ``[B, T]`` is the whole sequence the cache holds after the step, ``mask`` its attention mask (``[B, T]``,
    None: no padding), ``encoder_ids`` the encoder input (encoder-decoder models), ``reported_length`` what
    ``cache.get_seq_length()`` said after the step (None where undefined).
    """

    index: int
    op_index: int
    label: str
    start: int
    length: int
    logits: object
    seq: object
    reported_length: int | None
    mask: object = None
    encoder_ids: object = None


class SubjectRaised(Exception):
    """The subject (or the model through it) raised; ``where`` is the op label, ``cause`` the exception."""

    def __init__(self, where, cause):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.where = where
        self.cause = cause


def case_generator(case, model_name: str, salt: str = ""):
    """A ``torch.Generator`` seeded from the case id, the model name, ``case.seed`` and ``salt`` (stable across
    runs)."""
    import torch

    seed = zlib.crc32(f"{case.id}/{model_name}/{case.seed}{salt}".encode())
    return torch.Generator().manual_seed(seed)


def random_tokens(gen, batch: int, n: int, vocab: int):
    """``[batch, n]`` int64 tokens in ``[FIRST_TOKEN, vocab)``."""
    import torch

    return torch.randint(FIRST_TOKEN, vocab, (batch, n), generator=gen)


def encoder_ids_for(ctx, gen, batch=None):
    """Random encoder input ``[batch, case.encoder_len]`` for encoder-decoder models, else None."""
    return random_tokens(gen, batch or ctx.case.batch, ctx.case.encoder_len, ctx.model.vocab_size) \
        if ctx.model.is_encoder_decoder else None


def seq_length(cache):
    """``cache.get_seq_length()`` as an int, or None where it is undefined (an all-linear-attention cache raises)."""
    try:
        return int(cache.get_seq_length())
    except Exception:  # noqa: BLE001
        return None


_MASK_ON_WARM_STEPS: dict = {}


def wants_mask_after_prefill(model) -> bool:
    """Whether ``model`` takes the 2D attention mask on steps after the prefill, as ``generate`` passes it.

    Attention models take a mask over past + new tokens on every step. Mamba (v1) takes one over the new tokens
    only, and its ``prepare_inputs_for_generation`` drops the mask after the first iteration; we ask the model's own
    ``prepare_inputs_for_generation`` (no forward runs) instead of keeping a list of model types.
    """
    import torch

    key = type(model)
    if key not in _MASK_ON_WARM_STEPS:
        ids = torch.full((1, 2), FIRST_TOKEN, dtype=torch.long)
        try:
            inputs = model.prepare_inputs_for_generation(ids, attention_mask=torch.ones_like(ids), use_cache=True,
                                                         is_first_iteration=False, next_sequence_length=1)
            _MASK_ON_WARM_STEPS[key] = inputs.get("attention_mask") is not None
        except Exception:  # noqa: BLE001 - unknown architecture: pass the mask like attention models want it
            _MASK_ON_WARM_STEPS[key] = True
    return _MASK_ON_WARM_STEPS[key]


def forward_kwargs(m, cache, new_tokens, start: int, encoder_ids=None, positions: bool = True) -> dict:
    """Keyword arguments of one forward of the transformers model ``m`` over ``new_tokens`` ``[B, k]`` (int64) at
    sequence offsets ``start..start+k-1``: the cache under the installed forward's keyword (``compat.cache_kwarg``;
    ``cache=None`` → ``use_cache=False``, the uncached forward), ``input_ids`` (encoder-decoder models:
    ``encoder_ids`` ``[B, S_enc]`` as ``input_ids`` and the tokens as ``decoder_input_ids``) and, where the forward
    takes them and ``positions`` is true, explicit ``position_ids`` ``[B, k]``. Tensors are moved to ``m``'s device."""
    import torch

    device = next(m.parameters()).device
    kwargs = {"use_cache": False} if cache is None else {compat.cache_kwarg(m): cache, "use_cache": True}
    if encoder_ids is not None:
        kwargs.update(input_ids=encoder_ids.to(device), decoder_input_ids=new_tokens.to(device))
    else:
        kwargs["input_ids"] = new_tokens.to(device)
    if positions and compat.accepts_position_ids(m):
        k = new_tokens.shape[1]
        kwargs["position_ids"] = torch.arange(start, start + k, device=device).expand(new_tokens.shape[0], k)
    return kwargs


def forward(model, cache, new_tokens, start: int, position_mode: str, encoder_ids=None, mask=None, first=True):
    """One cached forward of ``new_tokens`` ``[B, k]`` at sequence offsets ``start..start+k-1``.

    Args:
        mask: the attention mask ``[B, start + k]`` of a left-padded batch (None: no padding). Positions are then
            ``cumsum(mask) - 1`` (what ``generate`` uses) and always passed explicitly where the model accepts them.
        first: this forward goes into an empty cache (the prefill), which decides whether a Mamba-style model gets
            the mask (see ``wants_mask_after_prefill``).

    Returns float64 logits ``[B, k, V]`` on CPU.
    """
    import torch

    m = model.model
    device = next(m.parameters()).device
    kwargs = forward_kwargs(m, cache, new_tokens, start, encoder_ids if model.is_encoder_decoder else None,
                            positions=mask is None and position_mode in ("explicit", "auto"))
    if mask is not None:
        k = new_tokens.shape[1]
        if first or wants_mask_after_prefill(m):
            kwargs["attention_mask"] = mask.to(device)
        if compat.accepts_position_ids(m):
            kwargs["position_ids"] = padded_position_ids(mask)[:, start:start + k].to(device)
    with torch.no_grad():
        out = m(**kwargs)
    return out.logits.detach().to("cpu", torch.float64)


def tensors_of(cache) -> dict:
    """``{name: tensor}`` of every tensor a cache holds in its layers (keys, values, length counters, conv and
    recurrent states), found by walking each layer's attributes, dicts and lists one level deep. For
    ``EncoderDecoderCache`` both halves are walked. Used to check data pointers and "nothing was written"."""
    import torch

    out = {}
    halves = [("self.", cache.self_attention_cache), ("cross.", cache.cross_attention_cache)] \
        if hasattr(cache, "self_attention_cache") else [("", cache)]
    for prefix, c in halves:
        for i, layer in enumerate(getattr(c, "layers", ()) or ()):
            for attr, value in sorted(vars(layer).items()):
                items = value.items() if isinstance(value, dict) else enumerate(value) \
                    if isinstance(value, (list, tuple)) else [(None, value)]
                for key, t in items:
                    if isinstance(t, torch.Tensor) and not attr.startswith("_"):
                        out[f"{prefix}layers[{i}].{attr}" + ("" if key is None else f"[{key}]")] = t
    return out


class Runner:
    """Drive one cache through ops; record a ``Step`` per forward.

    Args:
        ctx: the ``CheckContext``.
        cache: the subject's cache (fresh).
        position_mode: ``"auto"``, ``"explicit"`` or ``"implicit"`` (default: the case's).
        gen: token generator (default: seeded from the case and model, see ``case_generator``).
        padding: pad counts per row for a prefill into an empty cache (decoder-only models; default: the case's
            ``params.padding``, none); applied while the batch has one count per row (not after a repeat/select
            changed the batch size).

    Every method raises ``SubjectRaised`` naming the op when the subject (or the model through it) raises.
    """

    def __init__(self, ctx, cache, position_mode=None, gen=None, padding=None):
        import torch

        self.ctx, self.cache, self.model = ctx, cache, ctx.model
        self.position_mode = position_mode or ctx.case.position_ids
        self.gen = gen or case_generator(ctx.case, ctx.model.name)
        if padding is None:
            padding = ctx.case.params.get("padding")
        self.padding = None if (ctx.model.is_encoder_decoder or not padding) else [int(p) for p in padding]
        self.batch = ctx.case.batch
        self.encoder_ids = encoder_ids_for(ctx, self.gen)
        self.seq = torch.empty(self.batch, 0, dtype=torch.long)
        self.mask = None
        self.steps: list[Step] = []
        self.trail: list[str] = []
        self.parked: list[tuple] = []
        self.op_index = 0
        self.prefix = ""

    def branch(self, cache, label: str, gen=None) -> "Runner":
        """A runner that continues this one's sequence on ``cache`` (a copy of this cache, typically), recording into
        the same ``steps`` list with step labels prefixed by ``label``; ``gen`` draws its tokens (default: shared)."""
        other = copy.copy(self)
        other.cache, other.gen, other.prefix = cache, gen or self.gen, f"{label}: "
        other.seq, other.mask, other.encoder_ids, other.batch = self._state()
        other.trail, other.parked = list(self.trail), []
        return other

    # ------------------------------------------------------------------------------------------ helpers
    @property
    def length(self) -> int:
        """Tokens the cache should hold (pads included)."""
        return int(self.seq.shape[1])

    def _call(self, where, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - the subject's failure, reported on its item
            raise SubjectRaised(where, exc) from exc

    def _new_tokens(self, n):
        import torch

        new = random_tokens(self.gen, self.batch, n, self.model.vocab_size)
        if self.length == 0 and self.padding and len(self.padding) == self.batch:
            mask = torch.ones(self.batch, n, dtype=torch.long)
            for b in range(self.batch):
                p = min(self.padding[b], n - 1)
                new[b, :p] = PAD_TOKEN
                mask[b, :p] = 0
            return new, mask
        return new, None

    # ------------------------------------------------------------------------------------------ ops
    def feed(self, n: int, label: str | None = None, tokens=None) -> Step:
        """One forward of ``n`` new tokens (or the given ``tokens`` ``[B, n]``); returns its ``Step``."""
        import torch

        label = self.prefix + (label or (f"prefill({n})" if self.length == 0 else f"chunk({n})" if n > 1
                                         else "decode"))
        first = self.length == 0
        if tokens is None:
            new, new_mask = self._new_tokens(n)
        else:
            new, new_mask = tokens, None
        if self.mask is not None or new_mask is not None:
            grown = torch.ones(self.batch, n, dtype=torch.long) if new_mask is None else new_mask
            mask = grown if first else torch.cat([self.mask, grown], dim=1)
        else:
            mask = None
        start = self.length
        logits = self._call(label, forward, self.model, self.cache, new, start, self.position_mode,
                            self.encoder_ids, mask, first)
        self.seq = torch.cat([self.seq, new], dim=1)
        self.mask = mask
        step = Step(len(self.steps), self.op_index, label, start, n, logits, self.seq.clone(),
                    seq_length(self.cache), None if mask is None else mask.clone(),
                    None if self.encoder_ids is None else self.encoder_ids.clone())
        self.steps.append(step)
        return step

    def crop(self, n: int, label: str | None = None) -> None:
        """``crop(-n)`` through ``compat.crop``; the sequence loses its last ``n`` tokens (all, if fewer)."""
        label = label or f"crop(-{n})"
        self._call(label, compat.crop, self.cache, n, self.length)
        keep = max(self.length - n, 0)
        self.seq = self.seq[:, :keep]
        self.mask = None if self.mask is None or keep == 0 else self.mask[:, :keep]

    def fork(self, label: str = "fork"):
        """``copy.deepcopy(cache)``; continue on the copy, park the original (checked by ``check_parked``)."""
        copied = self._call(label, copy.deepcopy, self.cache)
        self.parked.append((f"original of {label} #{len(self.parked) + 1}", self.cache, self._state()))
        self.cache = copied
        return copied

    def _state(self):
        return (self.seq.clone(), None if self.mask is None else self.mask.clone(),
                None if self.encoder_ids is None else self.encoder_ids.clone(), self.batch)

    def _rows(self, index):
        self.seq = self.seq[index]
        self.mask = None if self.mask is None else self.mask[index]
        self.encoder_ids = None if self.encoder_ids is None else self.encoder_ids[index]
        self.batch = int(self.seq.shape[0])

    def reorder(self, perm=None, label: str = "reorder"):
        """``reorder_cache(perm)``; default ``perm``: rows rolled by one (non-identity for batch ≥ 2)."""
        import torch

        perm = torch.arange(self.batch).roll(1) if perm is None else torch.as_tensor(perm, dtype=torch.long)
        self._call(label, lambda: self.cache.reorder_cache(perm.to(self._device())))
        self._rows(perm)

    def repeat(self, r: int, label: str | None = None):
        """``batch_repeat_interleave(r)``: row ``b`` becomes rows ``b·r … b·r + r − 1``."""
        import torch

        self._call(label or f"repeat({r})", lambda: self.cache.batch_repeat_interleave(r))
        self._rows(torch.arange(self.batch).repeat_interleave(r))

    def select(self, indices=None, label: str = "select"):
        """``batch_select_indices(indices)``; default: every row but the first (row 0 for batch 1)."""
        import torch

        if indices is None:
            indices = torch.arange(1, self.batch) if self.batch > 1 else torch.zeros(1, dtype=torch.long)
        indices = torch.as_tensor(indices, dtype=torch.long)
        self._call(label, lambda: self.cache.batch_select_indices(indices.to(self._device())))
        self._rows(indices)

    def reset(self, label: str = "reset"):
        """``cache.reset()``; the next forward starts a new sequence (with a new encoder input)."""
        import torch

        self._call(label, lambda: self.cache.reset())
        self.seq = torch.empty(self.batch, 0, dtype=torch.long)
        self.mask = None
        if self.encoder_ids is not None:
            self.encoder_ids = encoder_ids_for(self.ctx, self.gen, self.batch)

    def _device(self):
        return next(self.model.model.parameters()).device

    def apply(self, op, op_index: int | None = None) -> None:
        """Run one ``cases.Op``."""
        if op_index is not None:
            self.op_index = op_index
        if op.name in ("prefill", "chunk"):
            self.feed(op.n, op.label)
        elif op.name == "decode":
            for s in range(op.n):
                self.feed(1, f"decode {s + 1}")
        elif op.name == "crop":
            self.crop(op.n, op.label)
        elif op.name == "fork":
            self.fork()
        elif op.name == "reorder":
            self.reorder()
        elif op.name == "repeat":
            self.repeat(op.n, op.label)
        elif op.name == "select":
            self.select()
        elif op.name == "reset":
            self.reset()
        else:
            raise ValueError(f"op {op.name!r} is not supported by the engine (case {self.ctx.case.id})")
        self.trail.append(op.label)

    def check_parked(self) -> None:
        """Feed one decode step into every parked original (forks): it must still hold its own sequence."""
        current = (self.cache, self._state())
        for label, cache, state in self.parked:
            self.cache = cache
            self.seq, self.mask, self.encoder_ids, self.batch = state
            if self.seq.shape[1] == 0:  # forked before any token: nothing to compare yet
                continue
            self.feed(1, f"{label}: decode")
        self.cache, (self.seq, self.mask, self.encoder_ids, self.batch) = current[0], current[1]
        self.parked = []


def run_ops(ctx, cache, position_mode: str | None = None, ops=None) -> list[Step]:
    """Execute ``ops`` (default ``ctx.case.ops``) on ``cache``, then check the parked originals of forks; return
    the recorded steps. Also sets ``ctx.encoder_ids`` (the first encoder input) for older callers.

    Raises:
        SubjectRaised: any exception during an op (names the op).
        ValueError: an op the engine does not implement.
    """
    runner = Runner(ctx, cache, position_mode)
    ctx.encoder_ids = runner.encoder_ids
    for i, op in enumerate(ctx.case.ops if ops is None else ops):
        runner.apply(op, i)
    runner.check_parked()
    return runner.steps


@dataclass
class Verdict:
    """Comparison of all steps: ``first_fail`` (step, Comparison) or None, and the ``worst`` pair overall."""

    first_fail: tuple | None
    worst: tuple

    @property
    def passed(self) -> bool:
        return self.first_fail is None


class PrefixOracle:
    """The oracle of many steps with few forwards: by causality the logits of a sequence's first ``T`` positions
    are those of any longer sequence that starts with it (same rows, same mask prefix, same encoder input), so each
    query is answered from the longest known sequence extending it (``ctx.oracle`` memoises that one forward).

    Args:
        oracle: the model's ``Oracle``.
        queries: ``(tokens [B, T], mask [B, T] or None, encoder_ids or None)`` the comparisons will ask for.
    """

    def __init__(self, oracle, queries):
        self.oracle = oracle
        self.known = sorted(queries, key=lambda q: -q[0].shape[1])

    @staticmethod
    def _extends(longer, query) -> bool:
        import torch

        (lt, lm, le), (qt, qm, qe) = longer, query
        t = qt.shape[1]
        if lt.shape[0] != qt.shape[0] or lt.shape[1] < t or not torch.equal(lt[:, :t], qt):
            return False
        if (lm is None) != (qm is None) or (qm is not None and not torch.equal(lm[:, :t], qm)):
            return False
        return (le is None and qe is None) or (le is not None and qe is not None and torch.equal(le, qe))

    def _longest(self, query):
        return next((k for k in self.known if self._extends(k, query)), query)

    def logits(self, tokens, attention_mask=None, encoder_ids=None):
        """float64 oracle logits ``[B, T, V]`` of ``tokens`` (sliced from the longest known extension)."""
        lt, lm, le = self._longest((tokens, attention_mask, encoder_ids))
        return self.oracle.logits(lt, attention_mask=lm, encoder_ids=le)[:, :tokens.shape[1]]

    def uncached(self, tokens, attention_mask=None, encoder_ids=None):
        """Case-dtype uncached logits ``[B, T, V]`` (as float64), the noise-floor reference, sliced likewise."""
        lt, lm, le = self._longest((tokens, attention_mask, encoder_ids))
        return self.oracle.uncached(lt, attention_mask=lm, encoder_ids=le)[:, :tokens.shape[1]]


def _encoder_of(ctx, step):
    return step.encoder_ids if step.encoder_ids is not None else getattr(ctx, "encoder_ids", None)


def prefix_oracle(ctx, steps) -> PrefixOracle:
    """A ``PrefixOracle`` over every sequence the ``steps`` will be compared on (the whole batch, or each row of a
    left-padded step without its pads; see ``compare_step``)."""
    queries = []
    for step in steps:
        if step.mask is None or bool(step.mask.all()):
            queries.append((step.seq, step.mask, _encoder_of(ctx, step)))
        else:
            queries += [(step.seq[b][step.mask[b].bool()].unsqueeze(0), None, None)
                        for b in range(step.seq.shape[0])]
    return PrefixOracle(ctx.oracle, queries)


def compare_step(ctx, step, tol, oracle=None, uncached=None, source=None):
    """Compare one step with the oracle (or the given ``oracle`` / ``uncached`` targets), pad positions excluded.

    A left-padded row is compared with the oracle of the same row *without* its pads (its valid tokens at positions
    0, 1, ...): a padded batch row must equal the prompt run alone. This also keeps the float64 oracle away from
    fully masked pad rows, which some models' eager attention turns into NaN in float64 (gemma2 computes its
    softmax in float32, where float64's mask minimum becomes -inf). ``source``: where oracle logits come from
    (default ``ctx.oracle``; ``judge`` passes a ``PrefixOracle``).
    """
    import torch

    source = source or ctx.oracle
    sl = slice(step.start, step.start + step.length)
    enc = _encoder_of(ctx, step)
    padded = step.mask is not None and not bool(step.mask.all())
    if oracle is None and not padded:
        oracle = source.logits(step.seq, attention_mask=step.mask, encoder_ids=enc)[:, sl]
        uncached = source.uncached(step.seq, attention_mask=step.mask, encoder_ids=enc)[:, sl]
    elif oracle is None:
        rows_o, rows_u = [], []
        for b in range(step.seq.shape[0]):
            valid = step.mask[b].bool()
            toks = step.seq[b][valid].unsqueeze(0)
            full_o = torch.zeros(1, step.seq.shape[1], step.logits.shape[-1], dtype=torch.float64)
            full_u = full_o.clone()
            full_o[:, valid] = source.logits(toks)
            full_u[:, valid] = source.uncached(toks)
            rows_o.append(full_o[:, sl])
            rows_u.append(full_u[:, sl])
        oracle, uncached = torch.cat(rows_o), torch.cat(rows_u)
    observed = step.logits
    if padded and not bool(step.mask[:, sl].all()):
        pad = ~step.mask[:, sl].bool()
        observed, oracle, uncached = observed.clone(), oracle.clone(), uncached.clone()
        oracle[pad] = 0.0
        observed[pad] = 0.0
        uncached[pad] = 0.0
    return compare_logits(observed, oracle, uncached, tol)


def judge(ctx, steps, spec=None, driver=None) -> Verdict:
    """Compare every step with the oracle under ``ctx.tolerance()``.

    ``spec`` is the subject that produced ``steps`` (default: ``ctx.subject``). A lossy subject (``spec.twin``) is
    compared with its fake-quant twin run on the same ops instead (``kvconform.checks._twin.twin_targets``); ``driver``
    (``fn(ctx, cache) -> steps``, default ``run_ops``) is how the twin replays them.
    """
    tol = ctx.tolerance()
    first_fail = worst = None
    spec = spec or ctx.subject
    twin = None
    if getattr(spec, "twin", None) is not None:  # lossy subject: the twin's float64 run is the target
        from kvconform.checks._twin import twin_targets

        twin = twin_targets(ctx, spec, steps, driver or run_ops)
    source = prefix_oracle(ctx, steps) if twin is None else None
    for step in steps:
        if twin is not None:
            cmp = compare_step(ctx, step, tol, *twin[step.index])
        else:
            cmp = compare_step(ctx, step, tol, source=source)
        if worst is None or cmp.max_abs > worst[1].max_abs:
            worst = (step, cmp)
        if first_fail is None and not cmp.passed:
            first_fail = (step, cmp)
    return Verdict(first_fail, worst)


def record_verdict(ctx, verdict: Verdict, steps: int, **extra) -> None:
    """Put a verdict's numbers in the item's metrics (JSON report): ``max_abs``, ``tolerance`` and ``noise_floor``
    (logit units) of the first failing step, else of the worst one, ``steps`` judged, plus ``extra``."""
    _, cmp = verdict.first_fail or verdict.worst
    ctx.metrics.update(max_abs=cmp.max_abs, tolerance=cmp.tol, noise_floor=cmp.floor, steps=steps, **extra)


MODEL_AT_FAULT = "transformers' modeling code mishandles this case, whatever the cache (see the known faults)"
"""The likely cause when kvconform's ReferenceCache fails the same case too: the fault is in the model."""


def token_mismatch(seq, ref_seq, what: str, reference: str) -> str:
    """One message line saying where two token sequences (``(batch, length)`` int64) first differ, or that their
    shapes differ. ``what`` names the subject's output, ``reference`` the uncached run it should equal."""
    if tuple(seq.shape) != tuple(ref_seq.shape):
        return f"{what} of shape {tuple(seq.shape)}, but {reference} gave {tuple(ref_seq.shape)}"
    b, i = (seq != ref_seq).nonzero()[0].tolist()
    return f"{what} differ from {reference} at batch={b} index={i}: {seq[b, i].item()} vs {ref_seq[b, i].item()}"


def run_and_judge(ctx, spec=None, position_mode=None, driver=None) -> Verdict:
    """Build a fresh cache of ``spec`` (default: the subject), run the case (or ``driver(ctx, cache)``), judge it."""
    import copy as _copy

    spec = spec or ctx.subject
    if driver is None:
        cache = ctx.new_cache(spec)
        return judge(ctx, run_ops(ctx, cache, position_mode), spec)
    sctx = _copy.copy(ctx)
    sctx.subject, sctx.metrics = spec, {}
    return judge(sctx, driver(sctx, sctx.new_cache()), spec, driver)


def describe_raise(exc: SubjectRaised) -> str:
    """``"IndexError: ... (at cache_utils.py:512 in update)"`` — the innermost frame of the subject's exception."""
    return describe_exception(exc.cause)


def describe_exception(cause: BaseException) -> str:
    """``"Type: first line (at file.py:line in function)"`` for any exception."""
    tb = traceback.extract_tb(cause.__traceback__)
    where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""
    text = str(cause).strip().splitlines()
    first = text[0][:200] if text else ""
    return f"{type(cause).__name__}: {first}{where}"


def oracle_line(ctx, position_mode=None, driver=None) -> tuple[str, bool]:
    """Run the same case (or ``driver``) on the reference subject; return (message line, model_at_fault)."""
    ref = ctx.reference
    if ref is None:
        return "", False
    if ref.name == ctx.subject.name:
        # The reference cache is the simplest correct cache (proven by kvconform's own tests): when it fails,
        # the model's code is at fault.
        return (f"oracle: {ref.name} is kvconform's reference cache → the fault is in the model, "
                f"not the cache"), True
    try:
        v = run_and_judge(ctx, ref, position_mode, driver)
    except SubjectRaised as exc:
        return f"oracle: {ref.name} on the same case raised {describe_raise(exc)}", False
    _, cmp = v.first_fail or v.worst
    if v.passed:
        return f"oracle: {ref.name} on the same case: {cmp.max_abs:.1e} → the fault is in the subject", False
    return (f"oracle: {ref.name} on the same case fails too ({cmp.max_abs:.1e}) → the fault is in the model, "
            f"not the cache"), True


def fail_verdict(ctx, verdict: Verdict, cause_fn, position_mode=None, ops_text=None, driver=None):
    """Raise the DESIGN §7 message for a failed verdict. ``cause_fn(step, cmp) -> str`` gives the likely cause in the
    subject; it is consulted only when kvconform's ReferenceCache passes the same case (else the cause is
    ``MODEL_AT_FAULT``)."""
    step, cmp = verdict.first_fail
    b, offset = cmp.worst
    position = step.start + offset
    ref_line, model_at_fault = oracle_line(ctx, position_mode, driver)
    observed = "NaN/inf" if cmp.max_abs == float("inf") else f"{cmp.max_abs:.1e}"
    tol_text = ctx.tolerance().describe(cmp.floor)
    ctx.fail([
        f"max|Δlogit| = {observed}{' vs its fake-quant twin' if getattr(ctx.subject, 'twin', None) else ''}, "
        f"but should be ≤ {cmp.tol:.1e} ({tol_text})",
        f"worst at batch={b} step={step.index} position={position}",
        f"ops: {ops_text or ctx.case.ops_label()}   [failed at {step.label}]"
        + f"; {positions_label(ctx)}",
        ref_line,
        "likely cause: " + (MODEL_AT_FAULT if model_at_fault else cause_fn(step, cmp)),
    ], {"max_abs": cmp.max_abs, "tolerance": cmp.tol, "noise_floor": cmp.floor, "failed_at": step.label,
        "position": position, "model_at_fault": model_at_fault})


def positions_label(ctx) -> str:
    """How positions were given: explicit ``position_ids`` or derived by the model from the cache."""
    explicit = ctx.case.position_ids != "implicit" and compat.accepts_position_ids(ctx.model.model)
    if ctx.case.params.get("padding") and not ctx.model.is_encoder_decoder:
        return "left-padded batch, attention_mask and explicit position_ids"
    return "explicit position_ids" if explicit else "no position_ids (derived from the cache)"


def fail_raised(ctx, exc: SubjectRaised, cause: str, ops_text=None):
    ctx.fail([
        f"the subject raised {describe_raise(exc)}",
        f"ops: {ops_text or ctx.case.ops_label()}   [raised at {exc.where}]",
        "likely cause: " + cause,
    ], {"raised": type(exc.cause).__name__, "failed_at": exc.where})


def generate(model, input_ids, max_new_tokens: int, cache_kwargs: dict, attention_mask=None, **extra):
    """Greedy ``model.generate`` of exactly ``max_new_tokens`` tokens; returns ``(sequences [B, L] int64 CPU,
    step logits [B, max_new_tokens, V] float64 CPU, output)``. ``cache_kwargs``: ``compat.generate_cache_kwargs``
    or ``{"use_cache": False}``."""
    import torch

    m = model.model
    device = next(m.parameters()).device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        out = m.generate(input_ids.to(device), attention_mask=attention_mask.to(device),
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, **cache_kwargs, **extra)
    logits = torch.stack([x.detach().to("cpu", torch.float64) for x in out.logits], dim=1)
    return out.sequences.cpu(), logits, out


def lossy_generate_rule(subject, model, case, **_):
    """Applicability rule for checks comparing ``generate`` tokens with the exact model: a lossy subject (one with a
    fake-quant ``twin``) is not held to that (``@register(..., applies=lossy_generate_rule)``)."""
    if getattr(subject, "twin", None) is not None:
        return (f"{subject.name} is lossy: its generate() tokens are not compared token for token with the exact "
                f"model")
    return None
