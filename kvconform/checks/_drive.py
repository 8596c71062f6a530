"""Driving a transformers model the way real callers do: one cached forward (``forward``, ``forward_kwargs``),
``model.generate`` (``generate``), seeded random tokens, and reading what a cache holds (``seq_length``,
``tensors_of``), and counting the bytes a cache holds (``held_bytes``, ``cache_layers``).

This is the lowest layer of the checks' machinery (``_drive`` < ``_interpreter`` < ``_judge`` < ``_diagnosis`` <
family modules, see ARCHITECTURE.md): it imports none of the others.
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
    pads = (getattr(ctx.case, "params", None) or {}).get("padding") or ()
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
    ``case.encoder_len`` for encoder-decoder models — the encoder input —, else ``case.prompt``), starting with the
    image on a VLM (``image_prompt``; a text or encoder-decoder model gets its tokens unchanged)."""
    n = n if n is not None else case.encoder_len if model.is_encoder_decoder else case.prompt
    return image_prompt(model, random_tokens(case_generator(case, model.name), case.batch, n, model.vocab_size))


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
    ``encoder_ids`` ``[B, S_enc]`` as ``input_ids`` and the tokens as ``decoder_input_ids``) and, where the forward
    takes them and ``positions`` is true, explicit ``position_ids`` ``[B, k]``. Tensors are moved to ``m``'s device."""
    import torch

    device = next(m.parameters()).device
    kwargs: dict[str, Any] = ({"use_cache": False} if cache is None
                              else {compat.cache_kwarg(m): cache, "use_cache": True})
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
    with torch.no_grad(), subject_call(cache, m):
        out = m(**kwargs)
    return out.logits.detach().to("cpu", torch.float64)


# ------------------------------------------------------------------------------------------------ reading a cache
# Every read of a subject's cache by kvconform's evidence code (its layers, their attributes) goes through these
# readers, which never raise on a cache's shape: ``layers`` as a list, tuple, dict (adaptivekv 0.1.0 keys its layers
# by index), a property returning a generator, None or missing; layers that are not ``CacheLayerMixin`` s (objects
# with ``__slots__``, without ``__dict__``, plain tensors); attributes and properties that raise.
def read_attr(obj, name: str, default=None):
    """``getattr(obj, name, default)``, or ``default`` when reading it raises (a property of the subject that
    raises answers nothing here; the checks that judge that property report it)."""
    try:
        return getattr(obj, name, default)
    except Exception:  # noqa: BLE001 - a property that raises answers nothing
        return default


def layer_items(cache) -> list:
    """``[(index, layer)]`` of ``cache.layers`` whatever its shape: a list or tuple (enumerated), a dict (its items,
    integer keys in order, then the others), another iterable that a property builds anew on each read (a
    generator); ``[]`` for None, a missing or raising ``layers``, an iterator stored on the instance (reading it would
    consume the subject's own state), or a non-iterable. Never raises."""
    import inspect

    layers = read_attr(cache, "layers")
    if layers is None:
        return []
    if isinstance(layers, dict):
        try:
            items = list(layers.items())
        except Exception:  # noqa: BLE001
            return []
        return sorted(items, key=lambda kv: (not isinstance(kv[0], int), kv[0] if isinstance(kv[0], int) else 0,
                                            str(kv[0])))
    if isinstance(layers, (list, tuple)):
        return list(enumerate(layers))
    try:
        stored = not isinstance(inspect.getattr_static(cache, "layers", None), property)
        if stored and iter(layers) is layers:  # an iterator held by the cache itself: reading it would consume it
            return []
        return list(enumerate(layers))
    except Exception:  # noqa: BLE001 - not iterable, or iterating it raised
        return []


def layers_problem(cache) -> str | None:
    """Why ``cache.layers`` (its self-attention half's) gives kvconform no layer to read, or None when it does (or
    the cache holds no layer yet): ``"cache.layers raised RuntimeError: ..."``, ``"cache.layers is None"``,
    ``"cache.layers is an int, not a list of layer objects"``, ``"cache.layers is a generator the cache holds
    (reading it would consume it)"``. For failure messages that count a cache without readable layers as one
    block."""
    target = self_half(cache)
    try:
        layers = getattr(target, "layers", None)
    except Exception as exc:  # noqa: BLE001 - the subject's property raised: that is the answer
        text = str(exc).strip().splitlines()
        return f"cache.layers raised {type(exc).__name__}: {text[0][:120] if text else ''}"
    if layers is None:
        return "cache.layers is None" if hasattr(target, "layers") else "the cache has no layers attribute"
    if layer_items(target) or (isinstance(layers, (list, tuple, dict)) and not layers):
        return None
    from kvconform.outcomes import with_article

    try:
        iter(layers)
    except Exception:  # noqa: BLE001
        return f"cache.layers is {with_article(type(layers).__name__)}, not a list of layer objects"
    return f"cache.layers is {with_article(type(layers).__name__)} the cache holds (reading it would consume it)"


def layer_list(cache) -> list:
    """The layers of ``cache`` (``layer_items`` without the indices)."""
    return [layer for _, layer in layer_items(cache)]


def attributes_of(obj) -> dict:
    """``{name: value}`` of ``obj``'s own attributes: its ``__dict__`` and its ``__slots__`` (those set), ``{}``
    for an object with neither (an int, a tensor is given as ``{}`` too: it is no layer object). Never raises."""
    import torch

    if obj is None or isinstance(obj, (int, float, str, bytes, bool, torch.Tensor)):
        return {}
    out = {}
    try:
        out.update(vars(obj))
    except Exception:  # noqa: BLE001 - no __dict__ (slots, a builtin), or a __dict__ that raises
        pass
    try:
        slots = [s for klass in type(obj).__mro__ for s in (getattr(klass, "__slots__", ()) or ())]
    except Exception:  # noqa: BLE001
        slots = []
    for slot in ([slots] if isinstance(slots, str) else slots):
        if isinstance(slot, str) and slot not in out and slot not in ("__dict__", "__weakref__"):
            value = read_attr(obj, slot, _MISSING)
            if value is not _MISSING:
                out[slot] = value
    return out


_MISSING = object()


def cache_halves(cache) -> list:
    """``[(prefix, cache)]``: ``[("self.", self_attention_cache), ("cross.", cross_attention_cache)]`` for an
    encoder-decoder cache (a half that is None is left out), else ``[("", cache)]``."""
    if read_attr(cache, "self_attention_cache") is None:
        return [("", cache)]
    return [(prefix, half) for prefix, half in (("self.", read_attr(cache, "self_attention_cache")),
                                                ("cross.", read_attr(cache, "cross_attention_cache")))
            if half is not None]


def tensors_of(cache) -> dict:
    """``{name: tensor}`` of every tensor a cache holds in its layers (keys, values, length counters, conv and
    recurrent states), found by walking each layer's attributes, dicts and lists one level deep. For
    ``EncoderDecoderCache`` both halves are walked. Used to check data pointers and "nothing was written". Never
    raises on a cache's shape (``layer_items``, ``attributes_of``); a layer that is itself a tensor is
    ``layers[i]``."""
    import torch

    out = {}
    for prefix, c in cache_halves(cache):
        for i, layer in layer_items(c):
            if isinstance(layer, torch.Tensor):
                out[f"{prefix}layers[{i}]"] = layer
                continue
            for attr, value in sorted(attributes_of(layer).items(), key=lambda kv: str(kv[0])):
                if str(attr).startswith("_"):
                    continue
                try:
                    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value)) \
                        if isinstance(value, (list, tuple)) else [(None, value)]
                except Exception:  # noqa: BLE001 - a container that cannot be read
                    continue
                for key, t in items:
                    if isinstance(t, torch.Tensor):
                        out[f"{prefix}layers[{i}].{attr}" + ("" if key is None else f"[{key}]")] = t
    return out


def generate(model, input_ids, max_new_tokens: int, cache_kwargs: dict, attention_mask=None, **extra):
    """``model.generate`` of exactly ``max_new_tokens`` tokens, greedy unless ``extra`` says otherwise (e.g.
    ``num_beams``); the one ``generate`` wrapper of the checks. A VLM's prompt (``vision.of``) gets its
    ``pixel_values`` (and ``token_type_ids``) passed to ``generate`` explicitly. Returns ``(sequences [B', L] int64
    CPU, step logits [B', max_new_tokens, V] float64 CPU, output)`` (``B'``: rows × beams for beam search).

    Args:
        model: a zoo model (its ``.model`` is used) or a transformers ``PreTrainedModel`` (e.g. the float64 oracle
            model).
        input_ids: the prompt ``[B, S]`` int64.
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
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
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
        out = m.generate(input_ids.to(device), attention_mask=attention_mask.to(device),  # type: ignore[operator]
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, **cache_kwargs, **extra)
    logits = torch.stack([x.detach().to("cpu", torch.float64) for x in out.logits], dim=1)
    return out.sequences.cpu(), logits, out


def nonfinite_in(cache) -> str | None:
    """Where the first NaN/inf is among the floating-point tensors a cache holds (``tensors_of``), e.g.
    ``"layers[1].keys[batch 0, head 1, position 5]"`` for a ``[B, H, T, D]`` key/value tensor (else the index), or None
    when all are finite. Measured in the cache itself, whatever the attention kernel later makes of it (some fused CPU
    attention kernels turn NaN keys into zeros, so the logits alone can look finite)."""
    import torch

    for name, t in tensors_of(cache).items():
        try:
            if not t.is_floating_point() or t.numel() == 0 or t.device.type == "meta":
                continue
            finite = torch.isfinite(t.detach())
            if bool(finite.all()):
                continue
            return _describe_index(name, t, ~finite)
        except Exception:  # noqa: BLE001 - a tensor subclass that cannot be read element-wise: not measured
            continue
    return None


def _describe_index(name: str, t, bad) -> str:
    index = [int(i) for i in bad.nonzero()[0].tolist()]
    if t.dim() == 4:
        return f"{name}[batch {index[0]}, head {index[1]}, position {index[2]}]"
    return f"{name}{index}"


class UpdateWatch:
    """Watches every ``update()`` call of a cache during one forward, from outside: the runner puts a wrapper on the
    cache *instance* (and on both halves of an ``EncoderDecoderCache``) for the duration of the forward and removes it
    after; the class and the tensors are untouched.

    Records in ``fault`` the first of:

    * ``update(layer_idx=i)`` returned NaN/inf keys or values (where: batch, head, position) — measured on what the
      cache hands to attention, whatever the attention kernel then makes of it;
    * ``update()`` wrote into the ``key_states`` / ``value_states`` it was given (the caller's tensors, which the
      model may still use: e.g. for the next layer's input or a draft model in speculative decoding).
    """

    def __init__(self, cache):
        self.fault: str | None = None
        self.dtype_fault: str | None = None
        """An ``update()`` that returned keys/values of another dtype than the states it was given: the likely cause
        when the forward then raises (``raise_facts``); not a fault of a forward that went through."""
        self.calls: list[list] = []
        """``[layer_idx, new tokens, returned key length or None]`` per ``update()`` of the (self-attention) cache,
        in call order; None: the call raised (or returned no tensor)."""
        self.mask_sizes: dict = {}
        """``{layer_idx: (kv_length, kv_offset)}`` the (self-attention) cache's ``get_mask_sizes`` returned during
        the forward (the attention mask is built from them)."""
        self._targets = [c for c in (getattr(cache, "self_attention_cache", None),
                                     getattr(cache, "cross_attention_cache", None)) if c is not None] or [cache]

    def _wrap_mask_sizes(self, target):
        original = target.get_mask_sizes

        def get_mask_sizes(*args, **kwargs):
            out = original(*args, **kwargs)
            layer_idx = kwargs.get("layer_idx", args[1] if len(args) > 1 else 0)
            try:
                self.mask_sizes[int(layer_idx)] = (int(out[0]), int(out[1]))
            except Exception:  # noqa: BLE001 - a malformed answer is the contract family's finding
                pass
            return out

        return get_mask_sizes

    def _wrap(self, target, record=False):
        import torch

        original = target.update

        def update(key_states, value_states, layer_idx, *args, **kwargs):
            before = (key_states.detach().clone(), value_states.detach().clone()) \
                if self.fault is None and isinstance(key_states, torch.Tensor) else None
            call = [layer_idx, int(key_states.shape[-2]) if isinstance(key_states, torch.Tensor) else None, None]
            if record:
                self.calls.append(call)
            out = original(key_states, value_states, layer_idx, *args, **kwargs)
            try:
                self._inspect(out, call, layer_idx, key_states, value_states, before)
            except Exception:  # noqa: BLE001 - an answer kvconform cannot inspect: the forward judges it
                pass
            return out

        return update

    def _inspect(self, out, call, layer_idx, key_states, value_states, before) -> None:
        """What one ``update()`` returned: the key length into ``call``, the faults into ``fault`` /
        ``dtype_fault``."""
        import torch

        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) and out[0].dim() >= 2:
            call[2] = int(out[0].shape[-2])
        if self.fault is None and before is not None:
            for what, given, kept in (("key_states", key_states, before[0]),
                                      ("value_states", value_states, before[1])):
                if given.shape == kept.shape and not torch.equal(given.detach(), kept):
                    self.fault = (f"update(layer_idx={layer_idx}) wrote into the {what} it was given (the "
                                  f"caller's tensor changed during the call)")
                    break
        if self.dtype_fault is None and isinstance(out, (tuple, list)) and isinstance(key_states, torch.Tensor):
            for what, t in zip(("keys", "values"), out):
                if isinstance(t, torch.Tensor) and t.dtype != key_states.dtype:
                    self.dtype_fault = (f"update(layer_idx={layer_idx}) returned {what} of dtype "
                                  f"{str(t.dtype).removeprefix('torch.')} for key/value states of dtype "
                                  f"{str(key_states.dtype).removeprefix('torch.')}: the attention then runs in "
                                  f"another dtype or raises; return the states' dtype (cast back after "
                                  f"dequantizing)")
                    break
        if self.fault is None and isinstance(out, (tuple, list)):
            for what, t in zip(("keys", "values"), out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
                    finite = torch.isfinite(t.detach())
                    if not bool(finite.all()):
                        self.fault = (f"update(layer_idx={layer_idx}) returned NaN/inf "
                                      f"{_describe_index(what, t, ~finite)}")
                        break

    def __enter__(self):
        self._saved = []
        for k, target in enumerate(self._targets):
            own = getattr(target, "__dict__", None)
            if not isinstance(own, dict) or not callable(read_attr(target, "update")):
                continue  # a cache without an instance __dict__ (slots) or update(): watched no further
            try:
                self._saved.append((target, "update", own.get("update")))
                target.update = self._wrap(target, record=k == 0)
                if k == 0 and callable(read_attr(target, "get_mask_sizes")):
                    self._saved.append((target, "get_mask_sizes", own.get("get_mask_sizes")))
                    target.get_mask_sizes = self._wrap_mask_sizes(target)
            except Exception:  # noqa: BLE001 - a cache whose attributes cannot be set (a __setattr__ of its own)
                continue
        return self

    def __exit__(self, *exc):
        for target, name, previous in self._saved:
            try:
                if previous is None:
                    target.__dict__.pop(name, None)
                else:
                    setattr(target, name, previous)
            except Exception:  # noqa: BLE001 - see __enter__
                continue
        return False


def raise_facts(cache, model, watch: UpdateWatch | None, held: int, batch: int, trail) -> dict:
    """What can be measured on ``cache`` right after a forward raised, for ``_diagnosis.measured_cause``.

    Args:
        cache: the subject's cache (an ``EncoderDecoderCache``'s self-attention half is measured).
        model: the ``ZooModel`` (its ``decoder_depth``).
        watch: the forward's ``UpdateWatch`` (``update()`` calls, ``get_mask_sizes`` answers), or None.
        held: tokens the cache should hold after the forward (pads included).
        batch: rows of the batch fed.
        trail: labels of the ops before this forward.

    Returns a dict: ``held``, ``batch``, ``trail``, ``update_calls`` / ``mask_sizes`` (from ``watch``),
    ``cache_layers`` (len of ``layers``, or None), ``grows_layers`` (layers appended on demand),
    ``decoder_depth``, ``layer_max`` (each layer's ``get_max_length()``, -1 unbounded, None unknown),
    ``kv_mismatch`` (``kv_length_mismatch``: an ``update()`` that returned a wrong number of keys, or None) and
    ``batch_sizes`` (``{tensor name: dim 0}`` of every ≥3-dim tensor the cache holds), ``shared_layers``
    (``shared_layers``: one layer object listed for several layers, or None), ``update_fault`` (what the
    watch saw an ``update()`` do wrong: another dtype returned, NaN returned, its inputs written; or None).
    """
    target = self_half(cache)
    layers = read_attr(target, "layers")
    facts: dict[str, Any] = {"held": int(held), "batch": int(batch), "trail": list(trail),
             "update_calls": [tuple(c) for c in (watch.calls if watch else ())],
             "mask_sizes": dict(watch.mask_sizes if watch else {}),
             "cache_layers": len(layers) if isinstance(layers, (list, tuple)) else None,
             "grows_layers": read_attr(target, "layer_class_to_replicate") is not None,
             "decoder_depth": getattr(model, "decoder_depth", None),
             "encoder_decoder": bool(getattr(model, "is_encoder_decoder", False)),
             # transformers' own Cache.update reads self.layers; a cache's own update() may keep its storage elsewhere
             "layers_updated": getattr(getattr(type(target), "update", None), "__module__", "")
             == "transformers.cache_utils"}
    facts["shared_layers"] = shared_layers(cache)
    facts["update_fault"] = (watch.fault or watch.dtype_fault) if watch else None
    facts["layer_max"] = layer_max_lengths(cache)
    facts["kv_mismatch"] = kv_length_mismatch(facts["update_calls"], facts["mask_sizes"], facts["layer_max"], held)
    try:
        facts["batch_sizes"] = {name: int(t.shape[0]) for name, t in tensors_of(cache).items() if t.dim() >= 3}
    except Exception:  # noqa: BLE001 - a cache too broken to walk: no batch measurement
        facts["batch_sizes"] = {}
    if not facts["batch_sizes"] and not layers:  # no layers: the cache keeps its storage in attributes of its own
        try:
            facts["batch_sizes"] = {path: int(t.shape[0]) for path, t in held_tensor_items(cache) if t.dim() >= 3}
        except Exception:  # noqa: BLE001 - a cache too broken to walk: no batch measurement
            pass
    facts["public_batch"], facts["keys_missing"] = public_kv_facts(cache)
    return facts


def public_kv_facts(cache) -> tuple[dict, list]:
    """What the layers answer as ``layer.keys`` / ``layer.values``, the tensors transformers itself reads (as
    attributes or properties): ``({"layer 0.keys": dim 0, ...}, [labels of layers that hold tokens, by
    get_seq_length(), but answer None or no tensor for keys])``. The first dimension of these is the batch by the
    Cache contract; a layer's other tensors may be laid out otherwise (a paged pool's first dimension counts pages)."""
    import torch
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    def answer(layer, attr):
        try:
            t = getattr(layer, attr, None)
        except Exception:  # noqa: BLE001 - a property that raises answers nothing
            return None
        return t if isinstance(t, torch.Tensor) and t.dim() >= 3 else None

    def holds_tokens(layer) -> bool:
        if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin):
            return False  # a linear-attention layer holds states, not keys (5.25 gives it a token count)
        try:
            return int(layer.get_seq_length()) > 0
        except Exception:  # noqa: BLE001 - no length to read: no claim
            return False

    sizes, missing = {}, []
    for label, layer in cache_layers(cache):
        keys, values = answer(layer, "keys"), answer(layer, "values")
        sizes.update({f"{label}.{attr}": int(t.shape[0]) for attr, t in (("keys", keys), ("values", values))
                      if t is not None})
        # a linear-attention layer holds states, not keys (no `keys` attribute at all): nothing is missing there
        if keys is None and _has_keys_attribute(layer) and holds_tokens(layer):
            missing.append(label)
    return sizes, missing



def _has_keys_attribute(layer) -> bool:
    """Whether ``layer`` has a ``keys`` attribute or property at all (an attention layer's; a linear-attention
    layer of transformers holds conv/recurrent states and has none)."""
    return "keys" in getattr(layer, "__dict__", {}) or any("keys" in vars(k) for k in type(layer).__mro__)


def unmasked_slots(cache, held: int, new_tokens: int, mask=None) -> str | None:
    """Evidence that a fixed-size cache is attended without its attention mask at a forward of ``new_tokens`` that
    left ``held`` tokens in it, or None: the cache reports a capacity larger than ``held`` while saying
    ``is_compileable = False`` — then the model's SDPA path drops the mask of unpadded single-token steps (it keeps
    it only for compileable caches) and attends the empty slots. ``mask``: the 2D attention mask passed (``[B, T]``,
    None: none); a padded one is kept by the model, so there is no evidence then."""
    if new_tokens != 1 or getattr(cache, "is_compileable", False):
        return None
    if mask is not None and not bool(mask.all()):
        return None
    # fixed-size storage: the layers' max_cache_len (a dynamic sliding layer reports its window as its maximum
    # length, but holds no empty slots); hybrid layers (a linear-attention state next to a fixed-size attention
    # part) report no capacity as a whole, their layers do
    layers = layer_list(self_half(cache))
    capacity = -1
    if layers:
        for layer in layers:
            try:
                capacity = max(capacity, int(read_attr(layer, "max_cache_len", -1) or -1))
            except Exception:  # noqa: BLE001
                continue
    else:
        try:
            capacity = int(compat.max_length(cache))
        except Exception:  # noqa: BLE001 - no capacity: an unbounded cache
            capacity = -1
    if capacity > held:
        return (f"the cache has {capacity} slots for {held} tokens but says is_compileable = False, so the model "
                f"drops the attention mask of single-token steps and the {capacity - held} empty slots are "
                f"attended (a fixed-size cache must stay compileable, or keep the mask)")
    return None


def layer_max_lengths(cache) -> list:
    """``get_max_length()`` of each layer of ``cache`` (its self-attention half): -1 unbounded, None unknown."""
    out: list[int | None] = []
    for layer in layer_list(self_half(cache)):
        try:
            out.append(compat.max_length(layer))
        except Exception:  # noqa: BLE001
            out.append(None)
    return out


def shared_layers(cache) -> str | None:
    """Why ``cache.layers`` (an encoder-decoder cache: its self-attention half) is wrong when it lists one layer
    object for several decoder layers (``[Layer()] * n``: every decoder layer writes into the same keys and
    values), else None."""
    layers = read_attr(self_half(cache), "layers")
    if not isinstance(layers, (list, tuple)):
        return None
    distinct = len({id(x) for x in layers})
    if distinct == len(layers):
        return None
    return (f"the cache's {len(layers)} layers are fewer distinct objects ({distinct}): one layer object is listed "
            f"for several decoder layers (e.g. layers = [Layer()] * n), so they all write into the same keys and "
            f"values — build one layer object per decoder layer")


def kv_length_mismatch(calls, mask_sizes: dict, layer_max: list, held: int) -> str | None:
    """The first ``update()`` of a forward that returned another number of keys than attention needs, or None.

    Args:
        calls: ``UpdateWatch.calls`` (``[layer_idx, new tokens, returned length or None]``).
        mask_sizes: ``UpdateWatch.mask_sizes`` (``{layer_idx: (kv_length, kv_offset)}``).
        layer_max: ``layer_max_lengths`` of the cache.
        held: tokens the cache should hold after the forward (pads included).

    An unbounded layer (``get_max_length() == -1``) must return every token held; a bounded one (static, sliding)
    the ``kv_length`` its ``get_mask_sizes`` gave the mask, where it was asked.
    """
    for layer_idx, _new, returned in calls:
        if returned is None or not isinstance(layer_idx, int) or layer_idx >= len(layer_max):
            continue
        if layer_max[layer_idx] == -1 and returned != held:
            return (f"update(layer_idx={layer_idx}) returned keys of length {returned} for a cache that should hold "
                    f"{held} tokens")
        if layer_max[layer_idx] not in (-1, None) and layer_idx in mask_sizes \
                and returned != mask_sizes[layer_idx][0]:
            return (f"update(layer_idx={layer_idx}) returned keys of length {returned}, but get_mask_sizes() sized "
                    f"the attention mask for {mask_sizes[layer_idx][0]} (the cache should hold {held} tokens)")
    return None

# ------------------------------------------------------------------------------------------------ counting bytes
# How bytes are counted (the memory family's formula checks and the quality family's compression / memory-bound
# checks): every tensor reachable from a cache's attributes, counted once per storage (a view keeps its whole buffer
# alive); a wrapper tensor subclass (optimum-quanto's QTensor: packed ``_data``, ``_scale``, ``_shift``) through its
# inner tensors (``__tensor_flatten__``), because its own ``nbytes`` is its logical, unpacked size.
def _opaque_types() -> tuple:
    import types

    return (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
            types.CodeType, types.FrameType, types.GeneratorType)


def _is_wrapper_subclass(t) -> bool:
    import torch

    return type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__")


def held_tensor_items(obj, max_depth: int = 8, skip=()) -> list:
    """``[(path, tensor)]`` for every plain tensor reachable from ``obj``'s attributes (lists, tuples, sets, dicts,
    objects with ``__dict__``/``__slots__``), in traversal order; ``path`` is how it was reached
    (``layers[0]._quantized_keys._data``). Wrapper tensor subclasses are replaced by their inner tensors;
    ``nn.Module``s, transformers configs, classes, functions (closures) and generators are not entered (a cache may
    refer to its model or config: their weights are not the cache's). Each object is visited once; the objects in
    ``skip`` are not entered (a layer's reference back to its cache or to a sibling layer: ``layer_bytes``)."""
    import torch

    try:
        from transformers import PretrainedConfig
    except ImportError:  # pragma: no cover
        PretrainedConfig = ()  # type: ignore[misc,assignment]
    opaque = _opaque_types()
    out, seen = [], {id(x) for x in skip if x is not obj}

    def visit(x, path, depth):
        if x is None or isinstance(x, (int, float, str, bytes, bool, torch.dtype, torch.device)):
            return
        if id(x) in seen or depth > max_depth:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if _is_wrapper_subclass(x):
                try:
                    names, _ = x.__tensor_flatten__()
                    inner = [(name, getattr(x, name)) for name in names]
                except Exception:  # noqa: BLE001 - a wrapper that cannot be flattened: counted as itself
                    out.append((path, x))
                    return
                for name, t in inner:
                    visit(t, f"{path}.{name}", depth + 1)
            else:
                out.append((path, x))
            return
        if isinstance(x, opaque) or isinstance(x, (torch.nn.Module, PretrainedConfig, torch.Generator)):
            return
        try:  # a container or object of the subject's that cannot be read holds nothing kvconform can count
            if isinstance(x, dict):
                children = [(f"{path}[{k!r}]", v) for k, v in list(x.items())]
            elif isinstance(x, (list, tuple)):
                children = [(f"{path}[{i}]", v) for i, v in enumerate(list(x))]
            elif isinstance(x, (set, frozenset)):
                children = [(f"{path}{{}}", v) for v in list(x)]
            else:
                children = [(f"{path}.{k}" if path else str(k), v) for k, v in attributes_of(x).items()]
        except Exception:  # noqa: BLE001
            return
        for child_path, v in children:
            visit(v, child_path, depth + 1)

    visit(obj, "", 0)
    return out


def held_tensors(obj, max_depth: int = 8, skip=()) -> list:
    """Every plain tensor reachable from ``obj`` (``held_tensor_items`` without the paths)."""
    return [t for _, t in held_tensor_items(obj, max_depth, skip)]


def _storage_key(t) -> tuple:
    """``(key, bytes)`` of the storage behind ``t`` (a sparse, meta or functional tensor: its own elements)."""
    try:
        storage = t.untyped_storage()
        return (t.device.type, storage.data_ptr(), storage.nbytes()), storage.nbytes()
    except Exception:  # noqa: BLE001 - a storage that cannot be read (RuntimeError, NotImplementedError, TypeError)
        try:
            return ("tensor", id(t)), t.numel() * t.element_size()
        except Exception:  # noqa: BLE001 - an odd tensor subclass: no bytes measured
            return ("tensor", id(t)), 0


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view costs its whole storage, once)."""
    total, seen = 0, set()
    for t in tensors:
        key, size = _storage_key(t)
        if size and key not in seen:
            seen.add(key)
            total += size
    return total


def held_bytes(obj, skip=()) -> int:
    """``storage_bytes(held_tensors(obj))``: bytes held by a cache, a layer, or any object (not entering ``skip``)."""
    return storage_bytes(held_tensors(obj, skip=skip))


def layer_bytes(cache) -> dict:
    """``{label: bytes}`` held by each layer of ``cache`` (``cache_layers``), each counted without entering the
    cache, its halves or the other layers: a layer that keeps a reference to its cache (or a sibling) is not charged
    for what they hold."""
    layers = cache_layers(cache)
    others = [cache, *(half for _, half in cache_halves(cache)), *(layer for _, layer in layers)]
    return {label: held_bytes(layer, skip=others) for label, layer in layers}


def largest_holdings(obj, n: int = 3) -> list:
    """``[(path, bytes, description)]`` of the ``n`` largest distinct storages ``obj`` holds, largest first
    (``description``: dtype and shape of the first tensor reached on it), for failure messages."""
    seen, rows = set(), []
    for path, t in held_tensor_items(obj):
        key, size = _storage_key(t)
        if size and key not in seen:
            seen.add(key)
            rows.append((path, size, f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"))
    return sorted(rows, key=lambda r: -r[1])[:n]


def cache_layers(cache) -> list:
    """``[(label, layer)]``: ``"layer 0"``… for a decoder cache; ``"self 0"``/``"cross 0"`` for an
    ``EncoderDecoderCache``. A cache without ``layers`` counts as one pseudo-layer ``"cache"``."""
    inner = [("self", read_attr(cache, "self_attention_cache")), ("cross", read_attr(cache, "cross_attention_cache"))]
    if inner[0][1] is not None:
        return [(f"{kind} {i}", layer) for kind, c in inner if c is not None for i, layer in layer_items(c)]
    layers = layer_items(cache)
    if not layers:
        return [("cache", cache)]
    return [(f"layer {i}", layer) for i, layer in layers]


def self_half(cache):
    """An encoder-decoder cache's self-attention half, else ``cache`` itself."""
    half = read_attr(cache, "self_attention_cache")
    return cache if half is None else half


def quant_params(layer) -> tuple | None:
    """``(nbits, group, residual)`` a quantized layer declares, or None for an exact layer.

    ``Fp8QuantizedLayer`` → ``(8, None, 0)`` (one per-tensor scale, no residual); ``QuantizedLayer`` (quanto, hqq)
    → ``(nbits, q_group_size, residual_length)``.
    """
    if read_attr(layer, "fp8_dtype", _MISSING) is not _MISSING:
        return (8, None, 0)
    nbits = read_attr(layer, "nbits")
    if isinstance(nbits, int) and not isinstance(nbits, bool):
        residual = read_attr(layer, "residual_length", 0)
        return (nbits, read_attr(layer, "q_group_size"), residual if isinstance(residual, int) else 0)
    return None


def narrow_stored(cache, dtype) -> list:
    """``[(path, dtype)]`` of the floating tensors ``cache`` holds less precisely than ``dtype`` (the model's: a larger
    ``torch.finfo(...).eps``), e.g. keys kept as bfloat16 for a float32 model, or for a float16 one (the same 16 bits,
    3 mantissa bits fewer); empty when every floating tensor is at least as precise. Integer tensors (indices, packed
    codes) are not counted: they are a quantized cache's compressed form, not a narrowed copy."""
    import torch

    if not dtype.is_floating_point:
        return []
    want = torch.finfo(dtype).eps
    return [(path, t.dtype) for path, t in held_tensor_items(cache)
            if t.is_floating_point() and t.numel() > 1 and torch.finfo(t.dtype).eps > want]
