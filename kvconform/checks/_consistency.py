"""Self-consistency targets: the judge's target for a lossy subject without a fake-quant twin.

A lossy cache (quantized, compressed) is not equal to the oracle, so an operation on it — crop, reorder, select,
repeat, reset and reuse, a deepcopy fork, a chunked continuation — cannot be judged against the oracle at float
tolerance: its own compression error would hide a fault or fail a correct cache. What such an operation promises is
that the cache afterwards behaves like *a fresh instance of the same class fed the equivalent history*: the same
tokens (``Step.seq[:, :start]``, rows already reordered / selected / repeated), in the same chunks (``Step.chunks``:
the forwards that fed them, a crop cutting the straddling one), with the same attention mask and encoder input. For
a deterministic class that is exact: the fresh instance computes the same quantization of the same tokens, so a
fault shows at its real size whatever the quantization noise, and the tolerance is the exact path's noise floor.

The fresh instance is kept in lock-step: it is reused from one step to the next while the subject's history only
grew by the previous step's forward, and replayed from scratch (its chunks, one forward each) only when the history
changed otherwise (after crop / reorder / select / repeat / reset / fork), so the cost stays about twice the
subject's own run.

This module sits above the interpreter (the fresh instance is fed through ``Runner.feed``, the one place that
feeds a cache); ``_judge.judge`` calls it.
"""

from __future__ import annotations

from kvconform.checks._interpreter import Runner
from kvconform.ops import CAUSES as OP_CAUSES, op_names

STRUCTURAL_OPS = op_names(feeds=False)
"""Ops after which the fresh instance is replayed (and which a divergence is blamed on): every op that does not feed
tokens (``kvconform.ops``)."""

CAUSES = OP_CAUSES
"""The likely cause of a divergence, by the last structural op before the first diverging step (``OpSpec.cause``)."""

NO_OP_CAUSE = ("the same calls on a fresh instance of the same class give other logits: the cache is not "
               "deterministic (state drawn per instance, e.g. an unseeded random rotation) or keeps state across "
               "instances (class-level buffers)")


def fresh_label(spec) -> str:
    """``"a fresh <Class> fed the equivalent history"`` — how failure messages name the target."""
    return f"a fresh {getattr(spec.factory, '__name__', spec.name)} fed the equivalent history"


def divergence_cause(steps, failed) -> str:
    """The likely cause of a lossy subject's first diverging step ``failed``: the last structural op (``CAUSES``)
    applied to its cache at or before that step (``Step.ops_before``), or ``NO_OP_CAUSE``."""
    by_index = {s.index: s for s in steps}
    for index in range(failed.index, -1, -1):
        step = by_index.get(index)
        if step is None:
            continue
        ops = [op for op in step.ops_before if op in CAUSES]
        if ops:
            where = "" if index == failed.index else f" (before {step.label})"
            return f"{CAUSES[ops[-1]]}{where}"
        if step.start == 0:  # a fresh history: nothing earlier is blamed
            break
    return NO_OP_CAUSE


class _Fresh:
    """A fresh instance of the subject's class and the history it holds (tokens ``[B, T]``, mask or None, encoder
    input or None, chunks, position mode), fed through the interpreter (``Runner.feed``)."""

    def __init__(self, ctx, cache, batch, enc, mode):
        import torch

        self.runner = Runner(ctx, cache, position_mode=mode, padding=[])
        self.runner.seq, self.runner.batch = torch.empty(batch, 0, dtype=torch.long), batch
        self.runner.encoder_ids = enc

    @property
    def seq(self):
        """The tokens it holds, ``[B, T]`` int64."""
        return self.runner.seq

    @property
    def mask(self):
        """Their attention mask ``[B, T]``, or None."""
        return self.runner.mask

    @property
    def enc(self):
        """The encoder input ``[B, E]``, or None."""
        return self.runner.encoder_ids

    @property
    def chunks(self) -> list:
        """The lengths of the forwards that fed it, oldest first."""
        return self.runner.chunks

    @property
    def mode(self) -> str:
        """How its forwards passed positions."""
        return self.runner.position_mode

    def holds(self, step, chunks, enc) -> bool:
        """Whether this instance holds exactly ``step``'s equivalent history (then it continues in lock-step)."""
        import torch

        start = step.start
        if self.chunks != chunks or self.mode != step.position_mode:
            return False
        if tuple(self.seq.shape) != (step.seq.shape[0], start) or not torch.equal(self.seq, step.seq[:, :start]):
            return False
        want = None if step.mask is None else step.mask[:, :start]
        if self.mask is not None or want is not None:
            have = self.mask if self.mask is not None else torch.ones_like(want)  # type: ignore[arg-type]  # one is set
            want = want if want is not None else torch.ones_like(have)
            if have.shape != want.shape or not torch.equal(have, want):
                return False
        return (self.enc is None and enc is None) or (self.enc is not None and enc is not None
                                                      and torch.equal(self.enc, enc))


def _record_like_subject(ctx, cache, label) -> None:
    """Turn past recording on in a fresh instance when the case turned it on in the subject (case params ``record``
    and ``record_states``: ``activate_past_recording()``, or ``activate_past_recording(recurrent_states_to_keep=N)``
    with N > 0), before its first token — the recording mode is part of the equivalent history: on transformers 5.25
    a forward of at most N tokens into a warm Mamba/Jamba cache that records N states runs the sequential scan on the
    cache's state, while without recording it runs the chunked scan from a zero state (a known model fault,
    ``mamba-jamba-prefix-zero-state``), so a fresh instance fed the same chunks without recording is 0.03 (mamba) /
    0.3 (jamba) off the oracle where the subject is right.

    Raises:
        SubjectRaised: the fresh instance refused the call (names the step it was replayed for).
    """
    params = ctx.case.params
    if not params.get("record") or not hasattr(cache, "activate_past_recording"):
        return
    keep = int(params.get("record_states") or 0)
    try:
        if keep:
            cache.activate_past_recording(recurrent_states_to_keep=keep)
        else:
            cache.activate_past_recording()
    except Exception as exc:  # noqa: BLE001 - the fresh instance's failure, reported on the subject's item
        from kvconform.checks._drive import SubjectRaised

        raise SubjectRaised(f"activate_past_recording() (a fresh instance replayed for {label})", exc) from exc


def _feed(ctx, fresh, tokens, mask_full, label):
    """One forward of ``tokens`` ``[B, n]`` into ``fresh`` (mask ``[B, start + n]`` or None) through the
    interpreter; returns the logits."""
    runner, n = fresh.runner, int(tokens.shape[1])
    start = runner.length
    runner.mask = None if mask_full is None or start == 0 else mask_full[:, :start]
    new_mask = None if mask_full is None else mask_full[:, start:start + n]
    return runner.feed(n, f"{label} (a fresh instance fed the equivalent history)", tokens=tokens,
                       tokens_mask=new_mask).logits


def consistency_targets(ctx, spec, steps) -> dict:
    """``{step.index: target}``: the float64 logits ``[B, length, V]`` of a fresh instance of ``spec`` (built like
    the subject: same factory, kwargs, model and dtype, batch size of the step) fed the step's equivalent history —
    ``step.seq[:, :step.start]`` in ``step.chunks`` forwards, with the step's mask, encoder input and position mode —
    then the step's own forward.

    The fresh instance continues in lock-step while the history only grows by the previous step (see the module
    docstring), so ``steps`` from one run cost about one more run; a fork, crop, reorder, select, repeat or reset
    costs one replay of the history.

    Raises:
        SubjectRaised: the fresh instance raised on the equivalent history (names the step).
    """
    out, fresh = {}, None
    for step in sorted(steps, key=lambda s: s.index):
        enc = step.encoder_ids if step.encoder_ids is not None else ctx.encoder_ids
        chunks = list(step.chunks) if sum(step.chunks) == step.start else ([step.start] if step.start else [])
        if fresh is None or not fresh.holds(step, chunks, enc):
            batch = int(step.seq.shape[0])
            cache = spec.build(ctx.model, max_cache_len=ctx.max_cache_len, batch_size=batch,
                               encoder_len=ctx.case.encoder_len)
            _record_like_subject(ctx, cache, step.label)
            fresh = _Fresh(ctx, cache, batch, enc, step.position_mode)
            pos = 0
            for n in chunks:
                mask = None if step.mask is None else step.mask[:, :pos + n]
                _feed(ctx, fresh, step.seq[:, pos:pos + n], mask, f"replay for {step.label}")
                pos += n
        mask = None if step.mask is None else step.mask[:, :step.start + step.length]
        out[step.index] = _feed(ctx, fresh, step.seq[:, step.start:step.start + step.length], mask, step.label)
    return out
