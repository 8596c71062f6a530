"""A model adapter's caches as subjects: ``ScratchCache`` (a ``transformers.Cache`` whose methods call the
adapter; the class is built on first use, so that importing ``kvconform.scratch`` does not import transformers) and
the ``CacheSpec`` s of an adapter (``subjects``)."""

from __future__ import annotations

import copy
import functools
import weakref

from kvconform.scratch.adapter import (_NOTES, AdapterError, AdapterUsageError, capabilities, compiled_decode,
                                       load_adapter, model_name)


def _torch():
    import torch

    return torch


@functools.cache
def scratch_cache_class():
    """The ``ScratchCache`` class: a ``transformers.Cache`` holding one adapter cache (``state``) and
    kvconform's own count of the tokens fed (``held``); every cache method calls the adapter. Built on first use
    (importing ``kvconform.scratch`` imports no transformers); the same class object every call."""
    from transformers import Cache

    class _ScratchCache(Cache):
        """One cache of a model adapter as a subject (see the module docstring). ``state`` is what the adapter's
        ``new_cache`` returned; ``held`` the tokens per row fed and not cropped (pads included); ``batch`` the
        rows."""

        is_compileable = False

        def __init__(self, adapter, net, batch_size: int, max_len: int, options=None):
            super().__init__(layers=[])
            self.adapter, self.options = adapter, dict(options or {})
            self._net = weakref.ref(net)
            self.batch, self.max_len, self.held = int(batch_size), int(max_len), 0
            self.renewed = False  # emptied by the default reset (new_cache) and not fed since
            self.state = adapter.new_cache(net, batch_size=self.batch, max_len=self.max_len, **self.options)

        def feed(self, net, ids, mask, **encoder):
            if self.renewed and int(ids.shape[0]) != self.batch:
                # the default reset built the empty cache for the old batch; the next forward brings another: the
                # cache is built for the batch it is fed (docs/from-scratch.md: reset, any batch size)
                self.batch = int(ids.shape[0])
                self.state = self.adapter.new_cache(net, batch_size=self.batch, max_len=self.max_len, **self.options)
            self.renewed = False
            out = self.adapter.forward(net, ids, self.state, self.held, mask, **encoder)
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                what = f"{len(out)} values" if isinstance(out, (tuple, list)) else type(out).__name__
                raise AdapterError(f"{type(self.adapter).__name__}.forward returned {what}, but should return "
                                   f"(logits [B, T, V], cache)")
            logits, state = out
            if state is None:
                raise AdapterError(f"{type(self.adapter).__name__}.forward returned None as its cache; it returns "
                                   f"(logits, cache)")
            self.state = state
            self.held += int(ids.shape[1])
            self.batch = int(ids.shape[0])
            return logits

        def get_seq_length(self, layer_idx: int = 0) -> int:
            own = getattr(self.adapter, "seq_length", None)
            return int(own(self.state)) if callable(own) else self.held

        def get_max_length(self) -> int:  # type: ignore[override]  # no layer_idx: one bound for every block
            own = getattr(self.adapter, "capacity", None)
            value = own(self.state) if callable(own) else None
            return -1 if value is None else int(value)  # None or -1: unbounded

        get_max_cache_shape = get_max_length

        @property
        def kvconform_poison(self):
            """The poisoned-capacity hook (``checks/poison.py``) when the adapter defines ``poison(cache, start,
            value) -> int`` (fill every slot the cache holds no token in, past the ``start`` tokens it holds, with
            ``value``; return how many token slots, rows × blocks, it filled), else None (no hook)."""
            own = getattr(self.adapter, "poison", None)
            if not callable(own):
                return None
            return lambda value: own(self.state, self.held, value)

        def crop(self, max_length: int):
            from kvconform.compat import crop_tokens_to_remove

            n = crop_tokens_to_remove(int(max_length), lambda: self.held)  # the installed release's contract
            fn = getattr(self.adapter, "crop", None)
            if not callable(fn):
                raise NotImplementedError(_NOTES["crop"])
            self.state = fn(self.state, n)
            self.held = max(self.held - n, 0)

        def _select(self, rows):
            fn = getattr(self.adapter, "select", None)
            if not callable(fn):
                raise NotImplementedError(_NOTES["batch_select"])
            torch = _torch()
            rows = torch.as_tensor(rows, dtype=torch.long)
            self.state = fn(self.state, rows)
            self.batch = int(rows.shape[0])

        def reorder_cache(self, beam_idx):
            self._select(beam_idx)

        def batch_select_indices(self, indices):
            self._select(indices)

        def batch_repeat_interleave(self, repeats: int):
            self._select(_torch().arange(self.batch).repeat_interleave(int(repeats)))

        def reset(self):
            own = getattr(self.adapter, "reset", None)
            if callable(own):
                self.state = own(self.state)
            else:  # new_cache for this batch now; the next forward rebuilds it if it brings another (feed)
                net = self._net()
                self.state = self.adapter.new_cache(net, batch_size=self.batch, max_len=self.max_len, **self.options)
                self.renewed = True
            self.held = 0

        def __deepcopy__(self, memo):
            new = object.__new__(type(self))
            for key, value in self.__dict__.items():
                if key == "state":
                    fork = getattr(self.adapter, "fork", None)
                    new.state = fork(value) if callable(fork) else copy.deepcopy(value, memo)
                elif key in ("adapter", "_net"):
                    new.__dict__[key] = value
                else:
                    new.__dict__[key] = copy.deepcopy(value, memo)
            return new

        def __repr__(self):
            return f"{type(self).__name__}({type(self.adapter).__name__}, held={self.held})"

    return _ScratchCache


@functools.cache
def adapter_cache_spec_class():
    """``AdapterCacheSpec``: a ``CacheSpec`` that also names the adapter spec it belongs to (``adapter_spec``);
    the plan pairs it with that model only (``plan.in_scope``)."""
    from dataclasses import dataclass

    from kvconform.subjects import CacheSpec

    @dataclass(frozen=True)
    class AdapterCacheSpec(CacheSpec):
        adapter_spec: str = ""
        compileable: bool | None = None  # the compiled decode step it declares: fullgraph, or None (none)

        def build(self, model, max_cache_len: int, batch_size: int, encoder_len: int = 0):
            """A fresh cache of the adapter's (never wrapped in ``EncoderDecoderCache``: an encoder-decoder
            adapter's own cache holds both halves, its cross-attention K/V from the encoder states its forward is
            given); ``max_cache_len`` is the decoder's length, ``encoder_len`` is not read."""
            device = next(model.model.parameters()).device
            return self.build_one(config=model.config, batch_size=batch_size, device=device, dtype=model.dtype,
                                  model=model.model, max_cache_len=max_cache_len)

    return AdapterCacheSpec


def allocation_of(adapter) -> dict:
    """The ``CacheSpec`` allocation fields an adapter declares: ``grows_by`` (its buffers grow in steps of that many
    tokens: the memory family allows one step of slack per row, ``page_size``) and ``allocation``
    (``"preallocated"``: a bounded cache holds its whole ``capacity`` from the first token; ``"doubling"``). Each
    judged against what the cache then holds.

    Raises:
        AdapterUsageError: ``grows_by`` not a positive int, or ``allocation`` not one of those names.
    """
    from kvconform.subjects.spec import ALLOCATIONS

    out: dict = {}
    grows_by = getattr(adapter, "grows_by", None)
    if grows_by is not None:
        if isinstance(grows_by, bool) or not isinstance(grows_by, int) or grows_by < 1:
            raise AdapterUsageError(f"{type(adapter).__name__}.grows_by must be a positive int (tokens per growth "
                                    f"step of its buffers), got {grows_by!r}")
        out["page_size"] = grows_by
    allocation = getattr(adapter, "allocation", None)
    if allocation is not None:
        if allocation not in ALLOCATIONS:
            raise AdapterUsageError(f"{type(adapter).__name__}.allocation must be one of {', '.join(ALLOCATIONS)}, "
                                    f"got {allocation!r}")
        out["allocation"] = allocation
    return out


def subjects(spec: str) -> list:
    """The adapter's caches as ``CacheSpec`` s (``caches``; default one named ``<Class>Cache``), each applying to
    this model only."""
    spec_class = adapter_cache_spec_class()
    adapter = load_adapter(spec)
    cls = scratch_cache_class()
    caches = getattr(adapter, "caches", None) or {f"{type(adapter).__name__}Cache": {}}
    name = model_name(adapter)
    out = []
    for subject, options in caches.items():
        caps = capabilities(adapter, subject)
        declared = compiled_decode(adapter, subject)
        compileable = None if declared is None else declared["fullgraph"]

        def factory(model, batch_size, max_cache_len, _options=dict(options), _compileable=compileable):
            cache = cls(model.adapter, model.net, batch_size, max_cache_len, _options)
            cache.is_compileable = bool(_compileable)
            return cache

        out.append(spec_class(subject, factory, capabilities=caps, source=f"model adapter {spec}",
                              adapter_spec=spec, compileable=compileable, **allocation_of(adapter),
                              applies_to=lambda info, _name=name: None if info.name == _name else "another model",
                              notes={k: v for k, v in _NOTES.items() if k not in caps}))
    return out


