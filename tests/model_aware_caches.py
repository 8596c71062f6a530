"""Model-aware subjects written the way their authors would: a cache built from the model (``for_model``), a
press-like context that hooks the model's attention modules (kvpress style), and faulty variants of both ideas.
Imported by tests/subjects/test_model_aware.py; every cache here is exact (lossless), so the exact families judge
them."""

import contextlib

import torch
from transformers import DynamicCache, StaticCache


def attention_modules(model):
    """The attention modules of a transformers model (those with a ``layer_idx``, named ``*Attention``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


class ForModelCache(DynamicCache):
    """A ``DynamicCache`` built from the model: ``for_model`` reads ``model.config`` and the model's dtype, and the
    cache refuses key/value states of another dtype (what a cache with preallocated buffers would need)."""

    def __init__(self, config, dtype):
        super().__init__(config=config)
        self.model_dtype = dtype

    @classmethod
    def for_model(cls, model):
        return cls(model.config, next(model.parameters()).dtype)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if key_states.dtype != self.model_dtype:
            raise TypeError(f"built for {self.model_dtype}, got {key_states.dtype}")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def for_model(model):
    return ForModelCache.for_model(model)


def _cache_of(kwargs):
    for name in ("past_key_values", "cache", "past_key_value"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


class IdentityPress:
    """A kvpress-style press: ``with press(model):`` registers a forward hook on every attention module that, after
    the prefill, "compresses" that layer of the cache by gathering the positions to keep — here all of them, in
    order, so the result is exact. ``calls`` counts hook calls, ``compressed`` prefill compressions; ``entered`` /
    ``exited`` count the contexts."""

    def __init__(self):
        self.calls = self.compressed = self.entered = self.exited = 0
        self.active = False

    def hook(self, module, args, kwargs, output):
        if not self.active:
            raise RuntimeError("IdentityPress hook called outside its context")
        self.calls += 1
        cache = _cache_of(kwargs)
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        layer = getattr(cache, "self_attention_cache", cache).layers[module.layer_idx] if cache is not None else None
        keys = getattr(layer, "keys", None)
        if keys is None or hidden is None or keys.shape[-2] != hidden.shape[1]:  # compress after the prefill only
            return output
        keep = torch.arange(keys.shape[-2], device=keys.device)  # the positions a real press would score and pick
        layer.keys = layer.keys.index_select(-2, keep).contiguous()
        layer.values = layer.values.index_select(-2, keep).contiguous()
        self.compressed += 1
        return output

    @contextlib.contextmanager
    def __call__(self, model):
        handles = [m.register_forward_hook(self.hook, with_kwargs=True) for m in attention_modules(model)]
        self.entered += 1
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self.exited += 1
            for handle in handles:
                handle.remove()


class LeakyPress(IdentityPress):
    """Faulty: its ``__exit__`` forgets to remove the hooks (they stay on the model, and raise once the press is
    no longer active)."""

    @contextlib.contextmanager
    def __call__(self, model):
        for m in attention_modules(model):
            m.register_forward_hook(self.hook, with_kwargs=True)
        self.entered += 1
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self.exited += 1


LEAKY = LeakyPress()


def leaky_pressed(config, model):
    return DynamicCache(config=config), LEAKY(model)


class PatchingPress:
    """Faulty in another way: a class-based context that patches ``forward`` on the instance of every attention
    module and does not put it back on exit."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        for m in attention_modules(self.model):
            m.forward = m.forward  # a bound method stored on the instance (what monkey-patchers do)
        return self

    def __exit__(self, *exc):
        return False


def patching_pressed(config, model):
    return DynamicCache(config=config), PatchingPress(model)


class RaisingCache(DynamicCache):
    """Raises in its second forward (layer 0's update of the first decode step)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.updates = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self.updates += 1
            if self.updates == 2:
                raise RuntimeError("boom in update")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


RAISING_PRESS = IdentityPress()


def raising_pressed(config, model):
    return RaisingCache(config), RAISING_PRESS(model)


def returns_press_not_context(config, model):
    """Faulty: returns the press itself, not ``press(model)``."""
    return DynamicCache(config=config), IdentityPress()


def forwards_kwargs(config, **kwargs):
    """A ``**kwargs`` forwarder (e.g. to a cache's options): is not handed ``model``."""
    if "model" in kwargs:
        raise TypeError("handed model through **kwargs")
    return DynamicCache(config=config)


class PressedCache(DynamicCache):
    """A DynamicCache that refuses an update made while ``PRESS`` is not entered: every forward kvconform makes with
    it must run inside the press's context."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not CHECKED_PRESS.active:
            raise RuntimeError("update outside the press's context")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


CHECKED_PRESS = IdentityPress()
MODELS = []


def checked_pressed(config, model):
    """``pressed`` whose cache proves the press is entered around each of its forwards; keeps the model it got."""
    MODELS.append(model)
    return PressedCache(config=config), CHECKED_PRESS(model)


def returns_cache_class(config, model):
    """Faulty: computes from the model's weights (so it cannot be built on a weightless model before the run), then
    returns the cache class instead of an instance."""
    scale = float(next(model.parameters()).abs().max())
    return DynamicCache if scale > 0 else None


def returns_triple(config):
    return DynamicCache(config=config), None, None


class Entries:
    """A context that only counts: ``entered`` / ``exited``; ``tag`` tells which factory call made it."""

    def __init__(self, tag):
        self.tag, self.entered, self.exited = tag, 0, 0

    def __enter__(self):
        self.entered += 1
        return self

    def __exit__(self, *exc):
        self.exited += 1
        return False


ENC_DEC_CONTEXTS = []


def counted(config, model):
    """Each call returns a new ``Entries`` context; those made for an encoder-decoder's real (not meta-device) model
    are kept in order in ``ENC_DEC_CONTEXTS`` (per build: self-attention, then cross-attention)."""
    context = Entries(len(ENC_DEC_CONTEXTS))
    if config.is_encoder_decoder and next(model.parameters()).device.type != "meta":
        ENC_DEC_CONTEXTS.append(context)
    return DynamicCache(config=config), context


class Switch:
    """A class-based context (entered again for every call) that only flips ``active``."""

    def __init__(self):
        self.active, self.entered = False, 0

    def __enter__(self):
        self.active = True
        self.entered += 1
        return self

    def __exit__(self, *exc):
        self.active = False
        return False


SWITCH = Switch()


class SwitchedStaticCache(StaticCache):
    """A StaticCache that refuses an update made while ``SWITCH`` is off (also inside compiled calls)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not SWITCH.active:
            raise RuntimeError("update outside the context")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def switched_static(config, max_cache_len, model):
    return SwitchedStaticCache(config=config, max_cache_len=max_cache_len), SWITCH
