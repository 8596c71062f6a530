"""The op interpreter: drive one cache (and, where a check needs it, a second cache in lock-step) through a
case's ops, the way real callers do, recording a ``Step`` per forward and calling observers around every op and
forward.

A ``Runner`` keeps the token sequence the cache is supposed to hold (``seq``, ``[B, T]`` int64), the attention mask
of a left-padded batch (``mask``, ``[B, T]`` int64, or None when nothing is padded) and, for encoder-decoder models,
the encoder input (``[B, E]``). Ops (``cases.Op``):

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
* ``swap_rows``: ``cache.reorder_cache(perm)`` with ``perm`` exchanging rows 0 and 1 (a beam swap).

The op vocabulary is one table, ``kvconform.ops.OPS``: ``Runner.apply`` dispatches an op to the method its entry
names (``OpSpec.runner``, ``op_<name>(op)``), so a new op is its table entry and that one method.

Checks observe a run instead of writing their own op loop: an observer is any object with some of the methods
``before_op(runner, op, op_index)``, ``after_op(runner, op, op_index)``, ``before_forward(runner, label, n)`` and
``after_forward(runner, step)`` (missing ones are skipped); ``Runner.observe`` adds one. A lock-step run
(``Runner(..., lockstep=cache2)``) applies every op to a second cache with the same tokens, recording its forwards
in ``Runner.lockstep_steps`` (same indices as ``steps``).

``_judge.judge`` compares each step with the oracle of the sequence as it was at that step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvconform import compat
from kvconform.failure import Cause
from kvconform.outcomes import breadcrumb
from kvconform.checks._drive import (PAD_TOKEN, SubjectRaised, case_generator, encoder_ids_for, forward, image_prompt,
                                     prefill_refusal, random_tokens, seq_length)
from kvconform.checks._evidence import (UpdateWatch, kv_length_mismatch, layer_max_lengths, nonfinite_in, raise_facts,
                                        shared_layers, unmasked_slots)
from kvconform.checks._measure import tensors_of
from kvconform.ops import OPS
from kvconform.checks._registry import BATCH_OPS
from kvconform.outcomes import CheckSkipped, KVConformError

if TYPE_CHECKING:  # tensor types without importing torch at module import
    from torch import Tensor


class StopRun(KVConformError):
    """Raised by an observer to end ``Runner.run`` early (what it has seen is enough for its verdict)."""


class LengthTrace:
    """Observer: after every op, ``(op label, tokens the runner says are held, cache.get_seq_length() or None)`` in
    ``rows`` — the bookkeeping a cache reports next to what it was fed."""

    def __init__(self):
        self.rows: list[tuple] = []

    def after_op(self, runner, op, op_index):
        """Record the lengths after ``op``."""
        self.rows.append((op.label, runner.length, seq_length(runner.cache)))


class PointerTrace:
    """Observer: after every forward, ``{tensor name: data_ptr}`` of every tensor the cache holds (``tensors_of``),
    in ``rows`` as ``(step label, pointers)`` — which buffers a cache reallocates, and when."""

    def __init__(self):
        self.rows: list[tuple] = []

    def after_forward(self, runner, step):
        """Record the cache's data pointers after ``step``."""
        self.rows.append((step.label, {k: t.data_ptr() for k, t in tensors_of(runner.cache).items()}))


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
    logits: Tensor
    seq: Tensor
    reported_length: int | None
    mask: Tensor | None = None
    encoder_ids: Tensor | None = None
    nonfinite: str | None = None
    """A fault measured in the cache itself at this step, or None: ``update()`` returned NaN/inf or wrote into its
    inputs (``_evidence.UpdateWatch``), or the cache holds NaN/inf (``_evidence.nonfinite_in``). It fails the step even
    where the logits look right (``_judge.judge``)."""
    kv_mismatch: str | Cause | None = None
    """An ``update()`` of this forward that returned another number of keys than the cache should hold
    (``_evidence.kv_length_mismatch``), or None; named first in the likely cause of a failure at this step."""
    unmasked: str | None = None
    """Evidence that this step attended empty slots of a fixed-size cache without a mask (``_evidence.unmasked_slots``),
    or None; the likely cause of a failure at this step when present."""
    chunks: tuple = ()
    """The chunk structure of the history the cache is supposed to hold before this forward: the lengths of the
    forwards that fed it, oldest first, summing to ``start`` (a crop cuts the straddling chunk; a reset empties it;
    reorder / select / repeat / fork keep it). With ``seq[:, :start]`` and ``mask`` it is the *equivalent history*
    a fresh instance of the same class is fed to give the target of a lossy subject (``_consistency``)."""
    position_mode: str = "auto"
    """How this forward passed positions (``"auto"``, ``"explicit"``, ``"implicit"``; see ``_drive.forward``)."""
    same_shapes: bool = True
    """Whether replaying ``chunks`` into a fresh cache repeats the subject's forwards shape for shape (same token
    counts, same batch size): False after a crop cut a forward's tokens in two or a repeat / select changed the batch
    size, until a reset. Then float rounding may differ from the subject's in the last bits (a lossy cache can turn
    that into a quantization level: ``_judge.judge`` allows for it)."""
    ops_before: tuple = ()
    """Names of the non-forward ops (``crop``, ``reorder``, ``repeat``, ``select``, ``reset``, ``fork``) applied to
    this cache since its previous forward, oldest first (what the divergence of a lossy subject is blamed on)."""


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
        observers: objects called around every op and forward (see the module docstring); more with ``observe``.
        lockstep: a second cache run in lock-step: every op is applied to it too, with the same tokens, and its
            forwards are recorded in ``lockstep_steps`` (labels prefixed by ``lockstep_label``).
        allowed_ops: op names this run accepts (default: all); another op raises ``ValueError`` naming
            ``ctx.check_name`` before anything runs.
        beam: ``reorder`` default permutation: ``"roll"`` (rows rolled by one) or ``"reverse"`` (rows reversed, so
            every row moves).
        decode_suffix_after_reorder: label decode steps that follow a reorder ``"decode k after reorder"``.
        handlers: ``{op name: fn(runner, op)}`` replacing the interpreter's own implementation of that op, for the
            check whose subject is that op (the crop family's crop: refusals judged, positive arguments); the
            handler keeps ``seq`` / ``mask`` and ``trail`` up to date itself.

    Every method raises ``SubjectRaised`` naming the op when the subject (or the model through it) raises.
    """

    def __init__(self, ctx, cache, position_mode=None, gen=None, padding=None, observers=(), lockstep=None,
                 lockstep_label="lockstep", allowed_ops=None, beam="roll", decode_suffix_after_reorder=False,
                 handlers=None):
        import torch

        self.ctx, self.cache, self.model = ctx, cache, ctx.model
        self.position_mode = position_mode or ctx.case.position_ids
        self.gen = gen or case_generator(ctx.case, ctx.model.name)
        if padding is None:
            padding = ctx.case.params.get("padding")
        self.padding = None if (ctx.model.is_encoder_decoder or not padding) else list(padding)
        # a gap under the item's smallest bound (abs_min: 3e-2 at bfloat16) cannot fail it alone: such an item
        # runs (RoFormer's 1e-3 at bfloat16), one over it (BART's 3.0) has no unpadded equivalent to judge
        if (self.padding and any(self.padding) and (gap := ctx.oracle.left_padding_gap(PAD_TOKEN)) is not None
                and gap > ctx.tolerance().abs_min):
            raise CheckSkipped(f"{ctx.model.name}'s own uncached forward in float64 puts a left-padded row "
                               f"{gap:.1e} (max|Δlogit|) from the same row alone, with the mask (and position_ids = "
                               f"cumsum − 1 where it takes them counted from 0), over the item's smallest bound "
                               f"{ctx.tolerance().abs_min:.1e}: its positions come from the slot, so a left-padded "
                               f"batch has no unpadded equivalent to compare with, whatever the cache")
        self.batch = ctx.case.batch
        self.encoder_ids = encoder_ids_for(ctx, self.gen)
        self.seq = torch.empty(self.batch, 0, dtype=torch.long)
        self.mask = None
        self.chunks: list[int] = []
        self.same_shapes = True
        self.pending: list[str] = []
        self.steps: list[Step] = []
        self.trail: list[str] = []
        self.op_names: list[str] = []
        self.parked: list[tuple] = []
        self.op_index = 0
        self.prefix = ""
        self.observers = list(observers)
        self.allowed_ops = None if allowed_ops is None else tuple(allowed_ops)
        self.beam = beam
        self.decode_suffix = decode_suffix_after_reorder
        self.handlers = dict(handlers or {})
        self.partner: Runner | None = None
        if lockstep is not None:
            self.partner = self.branch(lockstep, lockstep_label)
            self.partner.steps, self.partner.observers = [], []

    @property
    def lockstep_steps(self) -> list:
        """The lock-step cache's ``Step`` records (same order as ``steps``; empty without a lock-step cache)."""
        return [] if self.partner is None else self.partner.steps

    def observe(self, observer) -> "Runner":
        """Add an observer (see the module docstring); returns the runner."""
        self.observers.append(observer)
        return self

    def _notify(self, hook: str, *args) -> None:
        for obs in self.observers:
            fn = getattr(obs, hook, None)
            if fn is not None:
                fn(self, *args)

    def _mirror(self, method: str, *args, **kwargs) -> None:
        if self.partner is not None:
            getattr(self.partner, method)(*args, **kwargs)

    def branch(self, cache, label: str, gen=None) -> "Runner":
        """A runner that continues this one's sequence on ``cache`` (a copy of this cache, typically), recording into
        the same ``steps`` list with step labels prefixed by ``label``; ``gen`` draws its tokens (default: shared)."""
        other = copy.copy(self)
        other.cache, other.gen, other.prefix = cache, gen or self.gen, f"{label}: "
        other.seq, other.mask, other.encoder_ids, other.batch, other.chunks, other.same_shapes = self._state()
        other.pending = [*self.pending, "fork"] if self.length else []
        other.trail, other.op_names, other.parked = list(self.trail), list(self.op_names), []
        other.observers, other.partner = list(self.observers), None
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
            err = SubjectRaised(where, exc, op_index=self.op_index)
            reason = prefill_refusal(self.ctx, err) if self.length == 0 else None
            if reason:  # a clear refusal the contract allows (a padded batch; a press's too-short prompt)
                raise CheckSkipped(reason) from exc
            raise err from exc

    def _new_tokens(self, n):
        import torch

        new = random_tokens(self.gen, self.batch, n, self.model.vocab_size)
        if self.length == 0 and self.padding and len(self.padding) == self.batch:
            mask = torch.ones(self.batch, n, dtype=torch.long)
            pads = []
            for b in range(self.batch):
                p = min(self.padding[b], n - 1)
                new[b, :p] = PAD_TOKEN
                mask[b, :p] = 0
                pads.append(p)
            return image_prompt(self.model, new, pads), mask
        if self.length == 0:  # a prefill into an empty cache: a VLM's prompt starts with its image
            new = image_prompt(self.model, new)
        return new, None

    # ------------------------------------------------------------------------------------------ ops
    def feed(self, n: int, label: str | None = None, tokens=None, tokens_mask=None) -> Step:
        """One forward of ``n`` new tokens (or the given ``tokens`` ``[B, n]`` int64, with their pad mask
        ``tokens_mask`` ``[B, n]`` or None); returns its ``Step``. Observers see ``before_forward(runner, label, n)``
        and ``after_forward(runner, step)``; a lock-step cache gets the same tokens."""
        import torch

        plain = label
        label = self.prefix + (label or (f"prefill({n})" if self.length == 0 else f"chunk({n})" if n > 1
                                         else "decode"))
        first = self.length == 0
        if tokens is None:
            new, new_mask = self._new_tokens(n)
        else:
            new, new_mask = tokens, tokens_mask
        self._notify("before_forward", label, n)
        if self.mask is not None or new_mask is not None:
            grown = torch.ones(self.batch, n, dtype=torch.long) if new_mask is None else new_mask
            # (a later forward of a padded run has self.mask)
            mask = grown if first else torch.cat([self.mask, grown], dim=1)  # type: ignore[list-item]
        else:
            mask = None
        start = self.length
        self._cut_chunks(start)
        chunks = list(self.chunks)
        watch = UpdateWatch(self.cache)
        try:
            with watch:
                logits = self._call(label, forward, self.model, self.cache, new, start, self.position_mode,
                                    self.encoder_ids, mask, first)
        except SubjectRaised as exc:  # measured now, while the cache is as the raise left it (_diagnosis reads it)
            exc.facts.update(raise_facts(self.cache, self.model, watch, start + n, self.batch, self.trail))
            raise
        self.seq = torch.cat([self.seq, new], dim=1)
        self.mask = mask
        step = Step(len(self.steps), self.op_index, label, start, n, logits, self.seq.clone(),
                    seq_length(self.cache), None if mask is None else mask.clone(),
                    None if self.encoder_ids is None else self.encoder_ids.clone(),
                    watch.fault or nonfinite_in(self.cache),
                    shared_layers(self.cache)
                    or kv_length_mismatch(watch.calls, watch.mask_sizes, layer_max_lengths(self.cache), start + n),
                    unmasked_slots(self.cache, start + n, n, mask), tuple(chunks), self.position_mode,
                    self.same_shapes, tuple(self.pending))
        self.chunks, self.pending = [*chunks, n], []
        self.steps.append(step)
        self._notify("after_forward", step)
        self._mirror("feed", n, plain, tokens=new, tokens_mask=new_mask)
        return step

    def crop(self, n: int, label: str | None = None) -> None:
        """``crop(-n)`` through ``compat.crop``; the sequence loses its last ``n`` tokens (all, if fewer)."""
        label = label or f"crop(-{n})"
        self._call(label, compat.crop, self.cache, n, self.length)
        keep = OPS["crop"].held_after(self.length, n)
        self.seq = self.seq[:, :keep]
        self.mask = None if self.mask is None or keep == 0 else self.mask[:, :keep]
        self._cut_chunks(keep)
        self.pending.append("crop")
        self._mirror("crop", n, label)

    def fork(self, label: str = "fork"):
        """``copy.deepcopy(cache)``; continue on the copy, park the original (checked by ``check_parked``)."""
        copied = self._call(label, copy.deepcopy, self.cache)
        self.parked.append((f"original of {label} #{len(self.parked) + 1}", self.cache, self._state()))
        self.cache = copied
        self.pending.append("fork")
        self._mirror("fork", label)
        return copied

    def _state(self):
        return (self.seq.clone(), None if self.mask is None else self.mask.clone(),
                None if self.encoder_ids is None else self.encoder_ids.clone(), self.batch, list(self.chunks),
                self.same_shapes)

    def _cut_chunks(self, held: int) -> None:
        """Cut ``chunks`` to the ``held`` tokens (``_held_chunks``); a cut inside a forward's tokens means a replay no
        longer repeats the subject's forwards shape for shape (``Step.same_shapes``)."""
        cut = _held_chunks(self.chunks, held)
        if cut != self.chunks[:len(cut)]:
            self.same_shapes = False
        self.chunks = cut

    def _rows(self, index, op: str):
        self.pending.append(op)
        if self.length and len(index) != self.batch:
            self.same_shapes = False
        self.seq = self.seq[index]
        self.mask = None if self.mask is None else self.mask[index]
        self.encoder_ids = None if self.encoder_ids is None else self.encoder_ids[index]
        self.batch = int(self.seq.shape[0])

    def reorder(self, perm=None, label: str = "reorder"):
        """``reorder_cache(perm)``; default ``perm``: rows rolled by one (non-identity for batch ≥ 2), or reversed
        when the runner's ``beam`` is ``"reverse"``."""
        import torch

        if perm is None:
            perm = torch.arange(self.batch - 1, -1, -1) if self.beam == "reverse" else torch.arange(self.batch).roll(1)
        perm = torch.as_tensor(perm, dtype=torch.long)
        self._call(label, lambda: self.cache.reorder_cache(perm.to(self._device())))
        self._rows(perm, "reorder")
        self._mirror("reorder", perm, label)

    def repeat(self, r: int, label: str | None = None):
        """``batch_repeat_interleave(r)``: row ``b`` becomes rows ``b·r … b·r + r − 1``."""
        import torch

        self._call(label or f"repeat({r})", lambda: self.cache.batch_repeat_interleave(r))
        self._rows(torch.arange(self.batch).repeat_interleave(r), "repeat")
        self._mirror("repeat", r, label)

    def select(self, indices=None, label: str = "select"):
        """``batch_select_indices(indices)``; default: every row but the first (row 0 for batch 1)."""
        import torch

        if indices is None:
            indices = torch.arange(1, self.batch) if self.batch > 1 else torch.zeros(1, dtype=torch.long)
        indices = torch.as_tensor(indices, dtype=torch.long)
        self._call(label, lambda: self.cache.batch_select_indices(indices.to(self._device())))
        self._rows(indices, "select")
        self._mirror("select", indices, label)

    def reset(self, label: str = "reset", encoder_ids=None, batch: int | None = None):
        """``cache.reset()``; the next forward starts a new sequence (with a new encoder input: ``encoder_ids``
        ``[B, E]``, default drawn from the runner's generator) of ``batch`` rows (default: the current batch size;
        op ``reset B`` — reusing a cache object for a batch of another size)."""
        import torch

        self._call(label, lambda: self.cache.reset())
        self.batch = int(batch or self.batch)
        self.seq = torch.empty(self.batch, 0, dtype=torch.long)
        self.mask = None
        self.chunks = []
        self.same_shapes = True
        self.pending.append("reset")
        if self.encoder_ids is not None:
            self.encoder_ids = encoder_ids_for(self.ctx, self.gen, self.batch) if encoder_ids is None \
                else encoder_ids
        self._mirror("reset", label, self.encoder_ids, self.batch)

    def _device(self):
        return next(self.model.model.parameters()).device

    # ------------------------------------------------------------------ the ops of kvconform.ops, by OpSpec.runner
    def op_feed(self, op) -> None:
        """``prefill N`` / ``chunk N``: one forward of N new tokens."""
        self.feed(op.n, op.label)

    def op_decode(self, op) -> None:
        """``decode N``: N single-token forwards (labelled ``"decode k after reorder"`` after a reorder when the
        runner was made with ``decode_suffix_after_reorder``)."""
        after = " after reorder" if self.decode_suffix and "reorder" in self.op_names else ""
        for s in range(op.n):
            breadcrumb(f"decode {s + 1} of {op.n}{after}")
            self.feed(1, f"decode {s + 1}{after}")

    def op_crop(self, op) -> None:
        """``crop N``: ``crop(-N)``."""
        self.crop(op.n, op.label)

    def op_fork(self, op) -> None:
        """``fork``: ``copy.deepcopy``; the original is parked."""
        self.fork()

    def op_reorder(self, op) -> None:
        """``reorder``: the runner's default beam permutation (``beam``)."""
        self.reorder()

    def op_swap_rows(self, op) -> None:
        """``swap_rows``: a beam swap, ``reorder_cache(perm)`` with ``perm`` exchanging rows 0 and 1 (the others
        stay).

        Raises:
            ValueError: fewer than two rows.
        """
        self._reorder_rows(op, lambda index: index[[1, 0]])

    def op_beam_fork(self, op) -> None:
        """``beam_fork``: ``reorder_cache(idx)`` with ``idx = [0, 0, 2, 3, …]``: row 0 is taken twice and row 1 is
        dropped, as beam search's ``beam_idx`` holds one beam twice when both of its best continuations survive
        (``generate(num_beams=…)`` calls ``reorder_cache`` with such indices). The decode steps after it feed the two
        copies different tokens, so a cache whose copies still share storage (a page table pointing both rows at
        one page, without copy-on-write) shows it.

        Raises:
            ValueError: fewer than two rows.
        """
        self._reorder_rows(op, lambda index: index[[0, 0]])

    def _reorder_rows(self, op, first_two) -> None:
        """``reorder_cache(index)`` for a beam op on rows 0 and 1: ``index`` is ``arange(batch)`` with its first two
        entries replaced by ``first_two(index)`` (the other rows stay); the runner's rows and mirror follow.

        Raises:
            ValueError: fewer than two rows.
        """
        import torch

        if self.batch < 2:
            raise ValueError(f"op {op.name!r} needs two rows, the batch has {self.batch} (case {self.ctx.case.id})")
        index = torch.arange(self.batch)
        index[[0, 1]] = first_two(index)
        self._call(op.label, lambda: self.cache.reorder_cache(index.to(self._device())))
        self._rows(index, op.name)
        self._mirror(OPS[op.name].runner, op)

    def op_repeat(self, op) -> None:
        """``repeat R``: ``batch_repeat_interleave(R)``."""
        self.repeat(op.n, op.label)

    def op_select(self, op) -> None:
        """``select``: every row but the first."""
        self.select()

    def op_reset(self, op) -> None:
        """``reset`` / ``reset B``: a new sequence (of B rows)."""
        self.reset(op.label, batch=op.n or None)

    def apply(self, op, op_index: int | None = None) -> None:
        """Run one ``cases.Op`` (observers see ``before_op(runner, op, op_index)`` and ``after_op(...)``).

        Raises:
            SubjectRaised: the subject (or the model through it) raised.
            ValueError: an op the interpreter does not implement, or one outside ``allowed_ops``.
        """
        if op_index is not None:
            self.op_index = op_index
            if self.partner is not None:
                self.partner.op_index = op_index
        if self.allowed_ops is not None and op.name not in self.allowed_ops:
            raise ValueError(f"op {op.name!r} is not supported by {self.ctx.check_name} (case {self.ctx.case.id})")
        self._notify("before_op", op, self.op_index)
        spec = OPS.get(op.name)
        breadcrumb(op.label)
        if op.name in self.handlers:
            self.handlers[op.name](self, op)
            if spec is None or not spec.feeds:
                self.pending.append(op.name)
            self.op_names.append(op.name)
            self._notify("after_op", op, self.op_index)
            return
        method = getattr(self, spec.runner, None) if spec is not None else None
        if method is None:
            raise ValueError(f"op {op.name!r} is not supported by the engine (case {self.ctx.case.id})")
        method(op)
        self.trail.append(op.label)
        self.op_names.append(op.name)
        if self.partner is not None:
            self.partner.trail.append(op.label)
        self._notify("after_op", op, self.op_index)

    def run(self, ops=None, parked: bool = True, on_raise=None, plan=None, index_ops: bool = True) -> list:
        """Apply ``ops`` (default: the case's) in order, then (``parked``) check the parked originals of forks;
        returns ``steps``. An observer ends the run early by raising ``StopRun`` (then nothing more runs).

        ``plan(runner, op, op_index)``: decides each op in the runner's current state: returns the ``Op`` to apply
        (the same one, or a changed one) or None to skip it (a fuzzer keeping its random program valid).
        ``index_ops``: record each op's position in ``ops`` as its steps' ``op_index`` (False: keep the runner's
        current ``op_index``, e.g. for a branch continuing after the op that forked it).

        ``on_raise(runner, op, op_index, exc)``: called when an op raises ``SubjectRaised``; it returns True to go on
        with the next op (the refused op changed nothing the runner tracks), False to end the run, or raises.
        Without it the ``SubjectRaised`` propagates, like any other exception of ``apply``.
        """
        measured = self.ctx.measured if ops is None and plan is None else None  # the case's own ops, unchanged
        try:
            for i, op in enumerate(self.ctx.case.ops if ops is None else ops):
                if plan is not None:
                    op = plan(self, op, i)
                    if op is None:
                        continue
                if measured is not None and op.name in BATCH_OPS and op.name not in measured.expects_ops:
                    measured.expects_ops = (*measured.expects_ops, op.name)  # reached: applied or refused it must be
                try:
                    self.apply(op, i if index_ops else None)
                except SubjectRaised as exc:
                    if on_raise is None:
                        raise
                    if not on_raise(self, op, i, exc):
                        return self.steps
                    if measured is not None:
                        measured.applied(op.name, refused=True)
                else:
                    if measured is not None:
                        measured.applied(op.name)
            if parked:
                self.check_parked()
        except StopRun:
            pass
        return self.steps

    def check_parked(self) -> None:
        """Feed one decode step into every parked original (forks): it must still hold its own sequence. A lock-step
        cache's parked originals get the same token."""
        partner, self.partner = self.partner, None  # the partner follows its own parked originals, below
        try:
            current = (self.cache, self._state())
            mirror = None if partner is None else (partner.cache, partner._state())
            for k, (label, cache, state) in enumerate(self.parked):
                self.cache = cache
                self.seq, self.mask, self.encoder_ids, self.batch, self.chunks, self.same_shapes = state
                self.pending = ["fork"]
                if self.seq.shape[1] == 0:  # forked before any token: nothing to compare yet
                    continue
                step = self.feed(1, f"{label}: decode")
                if partner is not None:
                    plabel, partner.cache, pstate = partner.parked[k]
                    (partner.seq, partner.mask, partner.encoder_ids, partner.batch, partner.chunks,
                     partner.same_shapes) = pstate
                    partner.feed(1, f"{plabel}: decode", tokens=step.seq[:, -1:])
            self.cache, (self.seq, self.mask, self.encoder_ids, self.batch, self.chunks,
                         self.same_shapes) = current[0], current[1]
            self.parked = []
            if partner is not None:
                assert mirror is not None  # set above whenever there is a partner
                partner.cache, (partner.seq, partner.mask, partner.encoder_ids, partner.batch, partner.chunks,
                                partner.same_shapes) = mirror
                partner.parked = []
        finally:
            self.partner = partner


def _held_chunks(chunks, held: int) -> list:
    """``chunks`` (forward lengths, oldest first) cut to the first ``held`` tokens: chunks past ``held`` dropped, the
    straddling one shortened; when the runner holds more than they cover (a check's op handler fed tokens itself) the
    rest is one more chunk."""
    out, total = [], 0
    for n in chunks:
        if total >= held:
            break
        out.append(min(n, held - total))
        total += out[-1]
    if total < held:
        out.append(held - total)
    return out


def run_ops(ctx, cache, position_mode: str | None = None, ops=None) -> list[Step]:
    """Execute ``ops`` (default ``ctx.case.ops``) on ``cache``, then check the parked originals of forks; return
    the recorded steps. Also sets ``ctx.encoder_ids`` (the first encoder input) for older callers.

    Raises:
        SubjectRaised: any exception during an op (names the op).
        ValueError: an op the engine does not implement.
    """
    runner = Runner(ctx, cache, position_mode)
    ctx.encoder_ids = runner.encoder_ids
    return runner.run(ops)
