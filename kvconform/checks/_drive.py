"""Driving a transformers model the way real callers do: one cached forward (``forward``, ``forward_kwargs``),
``model.generate`` (``generate``), seeded random tokens and prompts, the per-call context of a subject
(``subject_call``) and a clear refusal of the first prefill (``prefill_refusal``).

What a cache holds is read in ``_measure`` (readers that never raise, bytes); what is measured when a forward fails
or raises in ``_evidence``. This module imports none of the other engine modules (ARCHITECTURE.md, "Layers").
"""

from __future__ import annotations

import zlib
from typing import Any

from kvconform import compat
from kvconform.memo import MEMO
from kvconform.outcomes import KVConformError, own_fault
from kvconform.outcomes import breadcrumb
from kvconform.oracle import padded_position_ids
from kvconform.subjects import call_context

FIRST_TOKEN = 3  # ids 0..2 are pad / bos / eos in the zoo
PAD_TOKEN = 0


class SubjectRaised(KVConformError):
    """The subject (or the model through it) raised; ``where`` is the op label, ``cause`` the exception.

    ``op_index``: the index of the raising op in the ops run (None when unknown). ``facts``: what was measured at the
    raise (``raise_facts``; empty when the raise was not inside a forward), read by ``_diagnosis.measured_cause``.
    ``internal``: ``outcomes.own_fault`` of the cause — where kvconform's own code (its reference cache, its
    wrappers) raised inside the call, which makes the item an error of kvconform (``checks.run_check``); None when
    the subject or the model raised.
    """

    def __init__(self, where, cause, op_index=None, facts=None):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.where = where
        self.cause = cause
        self.op_index = op_index
        self.facts = dict(facts or {})
        self.internal = own_fault(cause, through_subject_call=True)


_RAW = (IndexError, KeyError, AttributeError, ZeroDivisionError, RuntimeError, TypeError)
PAD_REFUSAL_WORDS = ("pad", "attention mask", "attention_mask")
SHORT_PROMPT_WORDS = ("token", "prompt", "length", "window", "sink", "short", "at least", "greater than")


def measure_reference(ctx, table: dict, run, read, on_raise):
    """What ``read(cache)`` measures of the reference cache (``ctx.reference``) after ``run(cache)`` drives it through
    the item's case: the same for every subject of a run, so memoised in ``table`` (a ``MEMO`` table) per model (name
    and source), dtype, case, batch and reference; the table is emptied past 64 entries. A ``SubjectRaised`` of the
    reference goes to ``on_raise(exc)``, which fails the item (the model's fault, in the family's words)."""
    from kvconform.checks._registry import Measured

    key = (ctx.model.name, ctx.model.source, str(ctx.model.dtype), ctx.case.id, ctx.case.batch, ctx.reference.name)
    if key not in table:
        ref = ctx.new_cache(ctx.reference)
        item, ctx.measured = ctx.measured, Measured()  # what the reference ran is not what the item measured
        try:
            run(ref)
        except SubjectRaised as exc:
            on_raise(exc)
        finally:
            ctx.measured = item
        if len(table) > 64:
            table.clear()
        table[key] = read(ref)
    return table[key]


def prefill_refusal(ctx, exc: "SubjectRaised") -> str | None:
    """The skip reason when the subject refused the first prefill of an empty cache clearly, else None: not a raw
    tensor error (``IndexError``, ``RuntimeError``...) but one naming the problem, for

    * a left-padded batch (the case pads its rows, ``params.padding``): a press cannot compress padded rows alike
      (``kvconform.testing.press``), so refusing them is its contract;
    * a press (``kind="press"``) and a prompt too short to compress (kvpress: ``AssertionError: Input should
      contain more tokens than n_sink=4``); ``check_press_contract`` judges short prompts.

    The contract allows such a refusal, so the case says nothing more about the subject.
    """
    if not str(exc.where).startswith("prefill") or isinstance(exc.cause, _RAW):
        return None
    text = str(exc.cause).lower()
    what = (f"{type(exc.cause).__name__}: "
            f"{str(exc.cause).strip().splitlines()[0][:160] if str(exc.cause).strip() else ''}")
    pads = (ctx.case.params or {}).get("padding") or ()
    if any(pads) and any(w in text for w in PAD_REFUSAL_WORDS):
        return (f"{ctx.subject.name} refuses a left-padded prefill with a clear error ({what}): padded rows are not "
                f"checked on this subject")
    if ctx.kind.presses and any(w in text for w in SHORT_PROMPT_WORDS):
        return (f"{ctx.subject.name} refuses a prompt this short with a clear error at {exc.where} ({what}): a press "
                f"may refuse a prompt it cannot compress (check_press_contract judges short prompts)")
    return None


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


def image_prompt(model, tokens, pads=None):
    """A prompt's first tokens ``[B, n]`` as the model takes them: for a VLM (``ZooModel.image``) with its image
    prefix placed after each row's ``pads`` (``vision.with_image``: key token, then the image block; the model's
    pre-forward hook gives the matching pixels to every forward that holds it), else ``tokens`` unchanged."""
    from kvconform import vision

    image = getattr(model, "image", None)
    return tokens if image is None else vision.with_image(image, tokens, pads)


def generate_prompt(model, case, n=None):
    """The seeded prompt of a ``generate``-based item, ``[case.batch, n]``: ``n`` tokens (default
    ``case.encoder_len`` for encoder-decoder models — the encoder input, ``encoder_input``: float features
    ``[case.batch, mel, frames]`` for whisper —, else ``case.prompt``), starting with the image on a VLM
    (``image_prompt``; a text or encoder-decoder model gets its tokens unchanged)."""
    gen = case_generator(case, model.name)
    if model.is_encoder_decoder and (n is None or encoder_features(model) is not None):
        return encoder_input(model, gen, case.batch, case.encoder_len if n is None else n)
    n = n if n is not None else case.prompt
    return image_prompt(model, random_tokens(gen, case.batch, n, model.vocab_size))


def encoder_features(model) -> tuple[int, int] | None:
    """``(mel bins, frames)`` of an encoder that takes float features (``ZooModel.encoder_features``: whisper), or
    None (token ids, or no encoder; a model without that property takes ids)."""
    return getattr(model, "encoder_features", None) if getattr(model, "is_encoder_decoder", False) else None


def encoder_input(model, gen, batch: int, length: int):
    """An encoder-decoder's seeded encoder input for ``batch`` rows, in the form its encoder takes: token ids
    ``[batch, length]`` int64 (t5, bart), or float features ``[batch, mel, frames]`` float64 drawn from a standard
    normal (whisper: ``encoder_features``, whose frames its forward fixes, so ``length`` is not read). Float
    features stay float64 here: the oracle reads them as they are and every case-dtype forward casts them
    (``compat.encoder_kwargs``), so both see the same input."""
    import torch

    shape = encoder_features(model)
    if shape is None:
        return random_tokens(gen, batch, length, model.vocab_size)
    return torch.randn((batch, *shape), generator=gen, dtype=torch.float64)


def encoder_ids_for(ctx, gen, batch=None):
    """The seeded encoder input of ``batch`` rows (default ``case.batch``) for encoder-decoder models
    (``encoder_input``: ``[batch, case.encoder_len]`` token ids, or whisper's float features), else None."""
    return encoder_input(ctx.model, gen, batch or ctx.case.batch, ctx.case.encoder_len) \
        if ctx.model.is_encoder_decoder else None


def seq_length(cache):
    """``cache.get_seq_length()`` as an int, or None where it is undefined (an all-linear-attention cache raises)."""
    try:
        return int(cache.get_seq_length())
    except Exception:  # noqa: BLE001
        return None


_MASK_ON_WARM_STEPS: dict = MEMO.table("drive.mask_on_warm_steps")


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


def subject_call(cache, m=None):
    """The context manager to run one model call with ``cache`` under: the per-call context of a subject built from
    a ``(cache, context)`` factory result (``subjects.CallContext.around``: entered, exited, ``m`` — an
    ``nn.Module``, default the factory's model — restored and checked), else a no-op. Every forward and ``generate``
    a check makes with a subject's cache goes through it (``forward``, ``generate``; the compile and speed families
    call it around their own model calls).

    Raises (on exit):
        subjects.ModelLeftChanged: the subject's context left ``m`` hooked or patched.
    """
    import contextlib

    context = call_context(cache)
    return context.around(m) if context is not None else contextlib.nullcontext()


def forward_kwargs(m, cache, new_tokens, start: int, encoder_ids=None, positions: bool = True) -> dict:
    """Keyword arguments of one forward of the transformers model ``m`` over ``new_tokens`` ``[B, k]`` (int64) at
    sequence offsets ``start..start+k-1``: the cache under the installed forward's keyword (``compat.cache_kwarg``;
    ``cache=None`` → ``use_cache=False``, the uncached forward), ``input_ids`` (encoder-decoder models:
    ``encoder_ids`` as the encoder's input — ``[B, S_enc]`` token ids or whisper's float features in ``m``'s dtype,
    ``compat.encoder_kwargs`` — and the tokens as ``decoder_input_ids``) and, where the forward
    takes them and ``positions`` is true, explicit ``position_ids`` ``[B, k]``. Tensors are moved to ``m``'s device."""
    import torch

    device = next(m.parameters()).device
    kwargs: dict[str, Any] = ({"use_cache": False} if cache is None
                              else {compat.cache_kwarg(m): cache, "use_cache": True})
    if encoder_ids is not None:
        kwargs.update(compat.encoder_kwargs(m, encoder_ids), decoder_input_ids=new_tokens.to(device))
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
    with torch.no_grad(), subject_call(cache, m):
        out = m(**kwargs)
    # an offloaded cache's layers are still moving (non_blocking copies, its prefetch stream): every read of the
    # cache that follows (evidence, bytes, the next op) waits for them
    compat.settle_streams(device)
    return out.logits.detach().to("cpu", torch.float64)


def generate(model, input_ids, max_new_tokens: int, cache_kwargs: dict, attention_mask=None, **extra):
    """``model.generate`` of exactly ``max_new_tokens`` tokens, greedy unless ``extra`` says otherwise (e.g.
    ``num_beams``); the one ``generate`` wrapper of the checks. A VLM's prompt (``vision.of``) gets its
    ``pixel_values`` (and ``token_type_ids``) passed to ``generate`` explicitly. Returns ``(sequences [B', L] int64
    CPU, step logits [B', max_new_tokens, V] float64 CPU, output)`` (``B'``: rows × beams for beam search).

    Args:
        model: a zoo model (its ``.model`` is used) or a transformers ``PreTrainedModel`` (e.g. the float64 oracle
            model).
        input_ids: the prompt ``[B, S]`` int64, or an encoder's float features ``[B, mel, frames]`` (whisper; cast
            to the model's dtype, no attention mask).
        cache_kwargs: ``compat.generate_cache_kwargs`` or ``{"use_cache": False}``; a subject's cache in it runs
            under its per-call context (``subject_call``).
        attention_mask: ``[B, S]`` (default: all ones).
        extra: more ``generate`` keyword arguments (``num_beams``, ``output_scores``...).
    """
    breadcrumb(f"generate(max_new_tokens={max_new_tokens})")
    import torch

    from kvconform import vision

    m = model if isinstance(model, torch.nn.Module) else model.model
    device = next(m.parameters()).device
    if input_ids.is_floating_point():  # an encoder's float features (whisper): in m's dtype, no mask over them
        input_ids = next(iter(compat.encoder_kwargs(m, input_ids).values()))
    elif attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask is not None:
        extra = {"attention_mask": attention_mask.to(device), **extra}
    image = vision.of(m)
    warm = any(seq_length(v) for v in cache_kwargs.values() if hasattr(v, "get_seq_length"))
    if image is not None and "pixel_values" not in extra and not warm:
        # a VLM's first turn: its pixels (and token_type_ids) go to generate() itself, as a processor's output does
        # (generate may build the attention masks before the first forward, for a compileable cache, from them). A
        # continuation of a cache that already holds the image gets none: transformers 5.24 raises "Image features
        # and image tokens do not match, tokens: 0" when they come again with a warm cache (llava, idefics3, gemma3)
        extra = {**vision.image_inputs(image, input_ids, next(m.parameters()).dtype, device), **extra}
    cache = next((v for v in cache_kwargs.values() if call_context(v) is not None), None)
    with torch.no_grad(), subject_call(cache, m):
        # (type: nn.Module.__getattr__ hides generate from mypy)
        out = m.generate(input_ids.to(device),  # type: ignore[operator]
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, **cache_kwargs, **extra)
    logits = torch.stack([x.detach().to("cpu", torch.float64) for x in out.logits], dim=1)
    return out.sequences.cpu(), logits, out


