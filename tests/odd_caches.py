"""Caches of unusual but working shapes, as published packages build them (adaptivekv 0.1.0 keeps its ``layers`` in
a dict of its own layer objects), for the tests that kvconform's own code never raises on a subject's shape
(``tests/engine/test_robust_reading.py``).

``odd_cache(form, layer_kind, extras, fault)`` returns a factory of a ``DynamicCache`` subclass that runs the model
exactly like DynamicCache (transformers' own code sees its real list of ``DynamicLayer`` s), while every other reader
— kvconform's evidence, diagnosis and byte counting — sees ``layers`` in the drawn ``form`` and its layers in the drawn
``layer_kind``, with the drawn ``extras`` attributes. ``fault="stale_value"`` makes ``update()`` return the first held
token's values scaled by 1.5 in layer 1, a fault every logits check must catch.
"""

from __future__ import annotations

import sys

import torch
from transformers import DynamicCache

FORMS = ("list", "tuple", "dict", "generator", "none", "raises", "int")
"""How ``layers`` looks from outside transformers: a list, a tuple, a dict ``{index: layer}``, a generator built on
each read, None, a property that raises, an int (no container at all)."""
LAYER_KINDS = ("transformers", "slots", "raising")
"""What each layer looks like from outside: transformers' own ``DynamicLayer``; a ``__slots__`` object that is no
``CacheLayerMixin`` (``keys``/``values`` as slots); a proxy whose every property raises but ``keys``/``values``."""
EXTRAS = ("meta_tensor", "deep_nesting", "non_tensor", "cycle", "raising_property")
"""Attributes added to each layer: a tensor on the meta device, tensors nested 12 deep in dicts and lists, non-tensor
values (a string, a lambda, a generator, a dtype, a device), a reference back to the cache, a property that raises."""


class SlotsLayer:
    """A layer that is no ``CacheLayerMixin``: keys and values in ``__slots__``, no ``__dict__``."""

    __slots__ = ("keys", "values", "layer_idx")

    def __init__(self, layer, i):
        self.keys, self.values, self.layer_idx = layer.keys, layer.values, i


class RaisingLayer:
    """A proxy of a layer whose ``keys`` / ``values`` answer and whose every other attribute raises."""

    def __init__(self, layer):
        object.__setattr__(self, "_layer", layer)

    @property
    def keys(self):
        return self._layer.keys

    @property
    def values(self):
        return self._layer.values

    def __getattr__(self, name):
        raise RuntimeError(f"RaisingLayer: {name} is not available")


class _RaisingProperty:
    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        raise ValueError("this property always raises")


def _from_transformers() -> bool:
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller.startswith("transformers")


def odd_cache(form: str, layer_kind: str, extras=(), fault: str | None = None):
    """A factory (``config`` → cache) of an odd-shaped ``DynamicCache`` (see the module docstring); its name says
    what was drawn."""
    extras = tuple(extras)

    odd_classes: dict = {}

    def odd_class(klass):  # a subclass of the layer's own transformers class: same storage and behaviour, odd extras
        if klass not in odd_classes:
            body = {"raising_property": _RaisingProperty()} if "raising_property" in extras else {}
            odd_classes[klass] = type(f"Odd{klass.__name__}", (klass,), body)
        return odd_classes[klass]

    class OddCache(DynamicCache):
        def __init__(self, config):
            super().__init__(config=config)
            for i, layer in enumerate(self.__dict__["_real"]):
                layer.__class__ = odd_class(type(layer))
                self._decorate(layer, i)

        def _decorate(self, layer, i):
            if "meta_tensor" in extras:
                layer.meta_scratch = torch.empty(2, 3, device="meta")
            if "deep_nesting" in extras:
                nest = torch.zeros(4)
                for depth in range(12):
                    nest = {"level": depth, "inner": [nest, torch.ones(1)]}
                layer.deep = nest
            if "non_tensor" in extras:
                layer.name, layer.fn, layer.kind = f"layer {i}", (lambda x: x), torch.float16
                layer.where, layer.stream = torch.device("cpu"), (x for x in range(3))
            if "cycle" in extras:
                layer.owner = self

        @property
        def layers(self):
            real = self.__dict__.get("_real", [])
            if _from_transformers():
                return real
            outside = [layer if layer_kind == "transformers" else SlotsLayer(layer, i) if layer_kind == "slots"
                       else RaisingLayer(layer) for i, layer in enumerate(real)]
            if form == "raises":
                raise RuntimeError("OddCache.layers is not readable from outside")
            return {"list": outside, "tuple": tuple(outside), "dict": dict(enumerate(outside)),
                    "generator": (x for x in outside), "none": None, "int": len(outside)}[form]

        @layers.setter
        def layers(self, value):
            self.__dict__["_real"] = value

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            if fault == "stale_value" and layer_idx == 1:
                values = values.clone()
                values[..., 0, :] *= 1.5
            return keys, values

    def factory(config):
        return OddCache(config)

    factory.__name__ = factory.__qualname__ = (f"Odd_{form}_{layer_kind}_{'_'.join(extras) or 'plain'}"
                                              + (f"_{fault}" if fault else ""))
    return factory
