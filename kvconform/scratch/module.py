"""A model adapter's model behind the forward keywords kvconform's drivers pass a transformers model
(``ScratchModule``, built on first use so that importing ``kvconform.scratch`` does not import torch), the model
built at a dtype (``build_model``), the float64 oracle (``oracle_module``) and its pre-check (``float64_problem``)."""

from __future__ import annotations

import functools
from typing import Any

from kvconform.scratch.adapter import (AdapterError, ModelForwardError, compiled_decode, is_encoder_decoder,
                                       layer_types, load_adapter, model_name, takes_mask, vocab_size)
from kvconform.scratch.cache import scratch_cache_class


def _torch():
    import torch

    return torch


class ScratchOutput:
    """What ``ScratchModule.forward`` returns: ``logits`` ``[B, T, V]`` and the cache (``past_key_values``);
    ``ScratchModule.generate`` sets ``sequences`` too (and ``logits``: one ``[B, V]`` per step)."""

    sequences: Any  # set by generate only (no class attribute: a forward's output has none)

    def __init__(self, logits, past_key_values=None):
        self.logits, self.past_key_values = logits, past_key_values


class ScratchConfig:
    """The little of a transformers config that kvconform's drivers read of a model adapter's model."""

    is_encoder_decoder = False

    def __init__(self, adapter):
        self.is_encoder_decoder = is_encoder_decoder(adapter)
        self.decoder_start_token_id = int(getattr(adapter, "decoder_start_token_id", 0))
        self.vocab_size = vocab_size(adapter)
        self.model_type = "scratch"
        self.sliding_window = getattr(adapter, "window", None)
        self.layer_types = list(layer_types(adapter))
        self.per_layer_config = [self for _ in self.layer_types]

    def get_text_config(self, decoder=True):
        """This config (a from-scratch model has one)."""
        return self


@functools.cache
def scratch_module_class():
    """The ``ScratchModule`` class (built on first use, so that importing ``kvconform.scratch`` does not import
    torch; the same class object every call)."""
    import torch

    class ScratchModule(torch.nn.Module):
        """A model adapter's model behind the forward keywords kvconform passes a transformers model:
        ``forward(input_ids, cache=None, use_cache=False, attention_mask=None, position_ids=None,
        decoder_input_ids=None)`` → ``ScratchOutput``. ``position_ids`` are not passed on: the adapter's model takes
        its positions from ``start`` (and the mask). An encoder-decoder adapter (``is_encoder_decoder``) gets, as a
        transformers encoder-decoder does, its encoder's token ids ``[B, S_enc]`` as ``input_ids`` and the decoder's
        as ``decoder_input_ids``: every forward encodes the rows' encoder ids (``adapter.encode``) and passes the
        states on as ``encoder=`` (a cache that keeps cross-attention K/V from its first forward must carry them
        through ``select`` with its rows itself). ``generate`` is kvconform's own greedy decoding over the cached
        forward."""

        adapter: Any  # the model adapter, kept out of nn.Module's registry (set through __dict__)

        def __init__(self, adapter, net):
            super().__init__()
            self.net = net
            self.__dict__["adapter"] = adapter
            self.config = ScratchConfig(adapter)

        def encode(self, encoder_ids):
            """``{"encoder": adapter.encode(net, encoder_ids)}`` for an encoder-decoder adapter, else ``{}`` (the
            keyword arguments both forwards get). Raises ``ModelForwardError`` where ``encode`` raises (the
            model's failure, never the cache's)."""
            if not self.config.is_encoder_decoder:
                return {}
            if encoder_ids is None:
                raise AdapterError(f"{type(self.adapter).__name__} is an encoder-decoder: every forward needs its "
                                   f"encoder input (input_ids, with the decoder's tokens as decoder_input_ids)")
            try:
                return {"encoder": self.adapter.encode(self.net, encoder_ids)}
            except Exception as exc:  # noqa: BLE001 - the model's failure, never the cache's
                raise ModelForwardError(f"{type(self.adapter).__name__}.encode on encoder ids of shape "
                                        f"{list(encoder_ids.shape)} raised {type(exc).__name__}: {exc}") from exc

        def forward(self, input_ids=None, cache=None, use_cache=False, attention_mask=None, position_ids=None,
                    decoder_input_ids=None):
            adapter = self.adapter
            extra = {}
            if self.config.is_encoder_decoder:
                extra = self.encode(input_ids)
                input_ids, attention_mask = decoder_input_ids, None  # the decoder is never left-padded
            elif decoder_input_ids is not None:
                raise AdapterError(f"{type(adapter).__name__} is a decoder-only model: it takes no decoder_input_ids")
            before = input_ids.clone()
            if cache is None or not use_cache:
                try:
                    logits = adapter.forward_uncached(self.net, input_ids, attention_mask, **extra)
                except Exception as exc:  # noqa: BLE001 - the model's failure, never the cache's (checks.escaped)
                    raise ModelForwardError(f"{type(adapter).__name__}.forward_uncached on ids of shape "
                                            f"{list(input_ids.shape)} ({next(self.net.parameters()).dtype}) raised "
                                            f"{type(exc).__name__}: {exc}") from exc
                where = "forward_uncached"
            else:
                if not isinstance(cache, scratch_cache_class()):
                    raise AdapterError(f"a from-scratch model takes its own caches only, not {type(cache).__name__}")
                logits = cache.feed(self.net, input_ids, attention_mask, **extra)
                where = "forward"
            _check_logits(logits, input_ids, vocab_size(adapter), where, self.net)
            if not torch.equal(input_ids, before):
                raise AdapterError(f"{type(adapter).__name__}.{where} changed the input ids in place (they must be "
                                   f"read only: kvconform keeps them as the sequence the cache holds)")
            return ScratchOutput(logits, cache)

        def compiled_forward(self, compile_fn, cache_name: str | None = None):
            """The decode step the adapter declares compiled (``compiled_decode``), compiled with ``compile_fn``
            (``torch.compile`` with the check's options), behind this module's forward keywords: ``call(input_ids,
            cache, use_cache=True, attention_mask=None, position_ids=None)`` → ``ScratchOutput``. Only the adapter's
            step (``decode_step(net, ids, state, pos)``, ``pos`` a 0-dim int64 tensor holding the start offset, or
            ``forward(net, ids, state, start)``) is compiled; kvconform's bookkeeping (the tokens held, the logits'
            shape and dtype) runs eagerly around it, after the compiled call returned (so a call that raises, e.g.
            a recompile refused by ``fail_on_recompile``, leaves the cache as it was).

            Raises:
                AdapterError: the step returned no ``(logits, cache)`` pair or wrong logits; the cache is no
                    ``ScratchCache``.
            """
            adapter = self.adapter
            names = list(getattr(adapter, "caches", None) or {f"{type(adapter).__name__}Cache": {}})
            declared = compiled_decode(adapter, cache_name or names[0]) or {"step": "forward"}
            step = getattr(adapter, declared["step"])
            compiled = compile_fn(step)
            tensor_pos = declared["step"] == "decode_step"
            what = f"{type(adapter).__name__}.{declared['step']}"

            def call(input_ids, cache: Any = None, use_cache=True, attention_mask=None, position_ids=None):
                if not isinstance(cache, scratch_cache_class()):
                    raise AdapterError(f"a from-scratch model takes its own caches only, not {type(cache).__name__}")
                if tensor_pos:
                    pos = torch.tensor(cache.held, dtype=torch.long, device=input_ids.device)
                    out = compiled(self.net, input_ids, cache.state, pos)
                else:
                    out = compiled(self.net, input_ids, cache.state, cache.held, attention_mask)
                if not isinstance(out, (tuple, list)) or len(out) != 2 or out[1] is None:
                    raise AdapterError(f"{what} returned {type(out).__name__}, but should return (logits [B, T, V], "
                                       f"cache)")
                logits, cache.state = out
                cache.renewed = False
                cache.held += int(input_ids.shape[1])
                cache.batch = int(input_ids.shape[0])
                _check_logits(logits, input_ids, vocab_size(adapter), declared["step"], self.net)
                return ScratchOutput(logits, cache)

            return call

        def kv_token_dims(self):
            """``(layers × kv_heads, head_dim)`` of the K/V the cache must hold per token and row, from the adapter's
            ``kv_layout`` (``{"layers", "kv_heads", "head_dim"}``), or None where it declares none: the memory
            family's byte formula (keys and values, in the model's dtype)."""
            layout = getattr(self.adapter, "kv_layout", None)
            if not isinstance(layout, dict):
                return None
            return int(layout["layers"]) * int(layout["kv_heads"]), int(layout["head_dim"])

        def generate(self, input_ids, attention_mask=None, max_new_tokens=1, num_beams=1, cache=None,
                     past_key_values=None, use_cache=True, **ignored):
            """Greedy decoding of ``max_new_tokens`` tokens: one forward of the tokens the cache does not hold yet
            (all of them without a cache), then one per new token. Returns ``.sequences`` ``[B, S + N]`` and
            ``.logits`` (one ``[B, V]`` per step), as transformers' ``generate(return_dict_in_generate=True,
            output_logits=True)``."""
            if num_beams != 1:
                raise NotImplementedError("kvconform drives greedy decoding of a from-scratch model only")
            cache = cache if cache is not None else past_key_values
            cache = cache if use_cache else None
            if self.config.is_encoder_decoder:  # input_ids: the encoder's; the decoder starts from its start token
                enc = input_ids
                seq = torch.full((enc.shape[0], 1), self.config.decoder_start_token_id, dtype=torch.long,
                                 device=enc.device)
                fresh = seq if cache is None else seq[:, cache.held:]
                steps = []
                for _ in range(int(max_new_tokens)):
                    out = self(enc, cache=cache, use_cache=cache is not None,
                               decoder_input_ids=seq if cache is None else fresh)
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                    steps.append(out.logits[:, -1])
                    seq, fresh = torch.cat([seq, nxt], dim=1), nxt
                result = ScratchOutput(None, cache)
                result.sequences, result.logits = seq, tuple(steps)
                return result
            seq, mask, steps = input_ids, attention_mask, []
            # a warm cache: the prompt's tokens it does not hold yet (the whole prompt when it is only the suffix)
            new = None if cache is None else seq[:, cache.held:] if seq.shape[1] > cache.held else seq
            for _ in range(int(max_new_tokens)):
                if cache is None:
                    logits = self(seq, attention_mask=mask).logits
                else:
                    logits = self(new, cache=cache, use_cache=True, attention_mask=mask).logits
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                steps.append(logits[:, -1])
                seq, new = torch.cat([seq, nxt], dim=1), nxt
                if mask is not None:
                    mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            out = ScratchOutput(None, cache)
            out.sequences, out.logits = seq, tuple(steps)
            return out

    return ScratchModule


def _check_logits(logits, ids, vocab: int, where: str, net) -> None:
    torch = _torch()
    expected = (ids.shape[0], ids.shape[1], vocab)
    if not isinstance(logits, torch.Tensor):
        raise AdapterError(f"forward returned {type(logits).__name__} as its logits, but should return a tensor "
                           f"of shape {list(expected)}")
    if tuple(logits.shape) != expected:
        raise AdapterError(f"{where} returned logits of shape {list(logits.shape)}, but should return "
                           f"{list(expected)} ([batch, new tokens, vocab_size] for ids of shape {list(ids.shape)})")
    want = next(net.parameters()).dtype if any(True for _ in net.parameters()) else logits.dtype
    if logits.dtype != want:
        raise AdapterError(f"{where} returned {logits.dtype} logits of shape {list(logits.shape)} from a "
                           f"{want} model, but should return {want} logits of shape {list(expected)}")


def scratch_module(adapter, net):
    """``ScratchModule(adapter, net)`` (the class is built on first use, so that importing this module does not
    import torch)."""
    return scratch_module_class()(adapter, net)


def build_model(spec: str, dtype=None, device: str = "cpu"):
    """The adapter's model as a ``zoo.ZooModel`` (its ``model`` a ``ScratchModule``; ``source`` the spec)."""
    torch = _torch()
    from kvconform.zoo import ZooModel

    adapter = load_adapter(spec)
    dtype = dtype or torch.float32
    net = adapter.build(dtype=dtype, device=device)
    module = scratch_module(adapter, net).eval()
    module.requires_grad_(False)
    window = getattr(adapter, "window", None)
    return ZooModel(name=model_name(adapter), model=module, config=module.config, dtype=dtype,
                    is_encoder_decoder=module.config.is_encoder_decoder, layer_types=layer_types(adapter),
                    sliding_window=window, source=spec,
                    oracle_build=lambda: oracle_module(adapter))


def oracle_module(adapter):
    """The oracle's model: ``adapter.build(dtype=torch.float64, device="cpu")`` (never a cast copy of the case
    dtype's model: a model that needs its own tables or patched modules in float64 builds them), wrapped in
    ``ScratchModule``, in eval mode without gradients."""
    torch = _torch()
    module = scratch_module(adapter, adapter.build(dtype=torch.float64, device="cpu")).eval()
    module.requires_grad_(False)
    return module


def float64_problem(spec: str) -> str | None:
    """Why the adapter's model cannot be the float64 oracle, or None: ``build(float64)`` or its uncached forward
    of 2 rows × 6 tokens raises, returns logits of another shape or dtype, or NaN/inf — without a mask and, unless
    the adapter declares ``takes_mask = False`` (no item then passes it one), with a left-padding mask. Checked once
    when the session is built (the oracle of every item is this forward)."""
    torch = _torch()
    adapter = load_adapter(spec)
    what = type(adapter).__name__
    try:
        net = adapter.build(dtype=torch.float64, device="cpu")
    except Exception as exc:  # noqa: BLE001
        return f"{what}.build(dtype=torch.float64) raised {type(exc).__name__}: {exc}"
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in net.parameters() if p.is_floating_point()})
    if dtypes and dtypes != ["float64"]:
        return (f"{what}.build(dtype=torch.float64) returned a model whose weights are {'/'.join(dtypes)}: build must "
                f"put the model in the dtype it is given (kvconform's oracle is its uncached forward in float64, and "
                f"the bfloat16 / float16 cases build it in those)")
    module = scratch_module(adapter, net)
    ids = (torch.arange(12).view(2, 6) * 7 + 3) % vocab_size(adapter)
    masks: tuple  # (label, mask or None) of each uncached forward tried
    if is_encoder_decoder(adapter):  # the decoder's 6 tokens after the encoder's 5 (it is never left-padded)
        enc = (torch.arange(10).view(2, 5) * 5 + 1) % vocab_size(adapter)
        calls, masks = f"{what}.encode / forward_uncached", (("", None),)

        def run(m):
            return module(enc, decoder_input_ids=ids).logits
    else:
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        calls, masks = f"{what}.forward_uncached", (("", None), (" with an attention mask (a left-padded row)", mask))
        masks = masks if takes_mask(adapter) else masks[:1]

        def run(m):
            return module(ids, attention_mask=m).logits
    try:
        narrow = narrow_computation(net, lambda: run(None))
    except Exception:  # noqa: BLE001 - the forward's own failure is reported below, naming it
        narrow = None
    if narrow:
        return (f"its uncached forward at float64 computes in a narrower dtype inside: {narrow} (kvconform's oracle "
                f"is this forward in float64: a module that casts to float32 — x.float() in a norm, a rotary table "
                f"built or kept in float32 — caps the oracle at float32's precision; compute in the input's dtype, "
                f"e.g. x.to(torch.promote_types(x.dtype, torch.float32)))")
    for label, m in masks:
        try:
            with torch.no_grad():
                logits = run(m)
        except Exception as exc:  # noqa: BLE001
            shown = exc.__cause__ if isinstance(exc, ModelForwardError) and exc.__cause__ is not None else exc
            return (f"its uncached forward fails at float64{label}: {calls} raised "
                    f"{type(shown).__name__}: {shown} (kvconform's oracle is this forward in float64: every dtype the "
                    f"model computes in must follow the weights')")
        if not torch.isfinite(logits[m.bool()] if m is not None else logits).all():
            return (f"its uncached forward at float64{label} returns NaN/inf logits: a mask or constant built in "
                    f"another dtype than the scores (e.g. a float32 mask multiplied by torch.finfo(float64).min, "
                    f"which overflows to -inf, and 0 × -inf = NaN) — build the mask in the scores' dtype")
    return None


def narrow_computation(net, run) -> str | None:
    """Where ``run()`` (a forward of the float64 model ``net``) computes in a narrower floating dtype: the first op
    inside one of ``net``'s modules that returns a float32 / float16 / bfloat16 tensor, as ``"module 'blocks.0.norm'
    (RMSNorm): Tensor.float returned float32"``, or None. Seen with a ``TorchFunctionMode`` (every torch function
    and tensor method) and forward hooks naming the innermost module running.

    Raises:
        Exception: whatever ``run`` raises.
    """
    torch = _torch()
    from torch.overrides import TorchFunctionMode

    narrow = (torch.float32, torch.float16, torch.bfloat16)
    names = {id(m): name or "(the model)" for name, m in net.named_modules()}
    stack: list = []
    found: list = []

    def tensors(out):
        if isinstance(out, torch.Tensor):
            yield out
        elif isinstance(out, (tuple, list)):
            for item in out:
                yield from tensors(item)

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not found and stack:
                bad = next((t for t in tensors(out) if t.dtype in narrow), None)
                if bad is not None:
                    mod = stack[-1]
                    what = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
                    found.append(f"module {names[id(mod)]!r} ({type(mod).__name__}): {what} returned "
                                 f"{str(bad.dtype).removeprefix('torch.')}")
            return out

    def enter(mod, args):
        stack.append(mod)

    def leave(mod, args, out):
        if stack:
            stack.pop()

    handles = []
    for m in net.modules():
        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        with torch.no_grad(), Watch():
            run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


