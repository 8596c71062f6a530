"""Reading what a subject's cache holds without ever raising on its shape (``read_attr``, ``layer_items``,
``layer_list``, ``attributes_of``, ``cache_halves``, ``self_half``, ``tensors_of``, ``cache_layers``) and counting the
bytes it holds (``held_bytes``, ``layer_bytes``, ``cache_bytes``, ``storage_bytes``, ``owned_by_model``). Evidence,
diagnosis and byte counting read a subject's cache only through these (ARCHITECTURE.md, "Reading a subject").
Imports no other engine module.
"""

from __future__ import annotations

import weakref

from kvconform.outcomes import with_article


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
    an ``nn.Module`` is entered (its own parameters and buffers, ``path.name``, its submodules and its other
    attributes): a cache made of modules (litgpt's, gpt-fast's and torchtune's ``KVCache``: k and v as registered
    buffers) holds what they hold. A transformers model (``PreTrainedModel``), transformers configs, classes,
    functions (closures) and generators are not entered (a cache may refer to its model or config: their weights are
    not the cache's); a cache that refers to a model written from scratch (or to modules of one) reaches its weights
    here, and the byte counts leave them out by storage (``exclude=owned_by_model(model)``). Each object is visited
    once; the objects in ``skip`` are not entered (a layer's reference back to its cache or to a sibling layer:
    ``layer_bytes``)."""
    import torch

    try:
        from transformers import PretrainedConfig, PreTrainedModel
    except ImportError:  # pragma: no cover
        PretrainedConfig = PreTrainedModel = ()  # type: ignore[misc,assignment]
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
                    names, _ = x.__tensor_flatten__()  # type: ignore[attr-defined]  # a wrapper subclass's
                    inner = [(name, getattr(x, name)) for name in names]
                except Exception:  # noqa: BLE001 - a wrapper that cannot be flattened: counted as itself
                    out.append((path, x))
                    return
                for name, t in inner:
                    visit(t, f"{path}.{name}", depth + 1)
            else:
                out.append((path, x))
            return
        if isinstance(x, opaque) or isinstance(x, (PreTrainedModel, PretrainedConfig, torch.Generator)):
            return
        try:  # a container or object of the subject's that cannot be read holds nothing kvconform can count
            if isinstance(x, torch.nn.Module):
                children = _module_children(x, path)
            elif isinstance(x, dict):
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


def _module_children(module, path: str) -> list:
    """``[(path, value)]`` of what an ``nn.Module`` holds: its own parameters and buffers, its submodules (each
    under its attribute name) and its attributes that are no part of ``nn.Module``'s own machinery (hook tables,
    flags)."""
    prefix = f"{path}." if path else ""
    out: list = []
    for table in ("_parameters", "_buffers", "_modules"):
        out.extend((prefix + str(name), value) for name, value in list((read_attr(module, table) or {}).items()))
    out.extend((prefix + str(name), value) for name, value in attributes_of(module).items()
               if name not in _module_internals())
    return out


def _module_internals() -> frozenset:
    """The attribute names every ``nn.Module`` instance has (``_parameters``, ``_forward_hooks``, ``training``...)."""
    global _MODULE_INTERNALS
    if _MODULE_INTERNALS is None:
        import torch

        _MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
    return _MODULE_INTERNALS


_MODULE_INTERNALS: frozenset | None = None


def held_tensors(obj, max_depth: int = 8, skip=()) -> list:
    """Every plain tensor reachable from ``obj`` (``held_tensor_items`` without the paths)."""
    return [t for _, t in held_tensor_items(obj, max_depth, skip)]


def storage_key(t) -> tuple:
    """``(key, bytes)`` of the storage behind ``t`` (a sparse, meta or functional tensor: its own elements): the one
    identity of a storage wherever it is reached (``held_storages``, ``owned_by_model``, the memory family's live
    tensor count)."""
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
        key, size = storage_key(t)
        if size and key not in seen:
            seen.add(key)
            total += size
    return total


def held_bytes(obj, skip=(), exclude=frozenset()) -> int:
    """``storage_bytes(held_tensors(obj))``: bytes held by a cache, a layer, or any object (not entering ``skip``;
    storages whose ``storage_key`` is in ``exclude`` are not counted: ``owned_by_model``)."""
    return sum(held_storages(obj, skip, exclude).values())


def held_storages(obj, skip=(), exclude=frozenset()) -> dict:
    """``{storage key: bytes}`` of the distinct storages reachable from ``obj`` (``held_tensors``), without the keys
    in ``exclude``."""
    out: dict = {}
    for t in held_tensors(obj, skip=skip):
        key, size = storage_key(t)
        if size and key not in exclude:
            out.setdefault(key, size)
    return out


_OWNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""``{model: (fingerprint, keys)}``: ``owned_by_model`` of transformers models, reused while the model's parameters
and buffers are the same storages (a walk of every module's attributes costs ~6 ms on a tiny zoo model, and the
memory family measures after every op); an entry goes with its model."""


def _storage_fingerprint(model) -> tuple:
    """The ``data_ptr`` of every parameter and buffer of ``model``, in order (~0.15 ms on a tiny zoo model)."""
    return (tuple(p.data_ptr() for p in model.parameters()), tuple(b.data_ptr() for b in model.buffers()))


def owned_by_model(model) -> frozenset:
    """Storage keys (``storage_key``) of every tensor a model owns: its parameters and buffers, and the tensors its
    modules reach through attributes that are no modules (a from-scratch model's adapter and what its setup calls
    put there: a rotary table rebuilt by ``new_cache``). A cache that refers to them does not hold them: the model
    does, with or without the cache (the memory family counts what the cache owns). Never raises.

    A transformers model's answer is remembered (``_OWNED``) while its parameters and buffers keep their storages (a
    cast or a reload gives new ones and a new walk); a model written from scratch is walked at every call, since its
    setup may put new tensors on it at any time."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return frozenset()
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        PreTrainedModel = ()  # type: ignore[misc,assignment]
    if not isinstance(model, PreTrainedModel):
        return _owned_by_model(model)
    try:
        fingerprint = _storage_fingerprint(model)
    except Exception:  # noqa: BLE001 - a module tree that cannot be walked: measured the long way
        return _owned_by_model(model)
    known = _OWNED.get(model)
    if known is not None and known[0] == fingerprint:
        return known[1]
    keys = _owned_by_model(model)
    _OWNED[model] = (fingerprint, keys)
    return keys


def _owned_by_model(model) -> frozenset:
    """``owned_by_model`` measured: every module's parameters, buffers and the tensors its other attributes reach."""
    import torch

    keys: set = set()
    try:
        modules = list(model.modules())
    except Exception:  # noqa: BLE001 - a module tree that cannot be walked: nothing is the model's
        return frozenset()
    for module in modules:
        try:
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        except Exception:  # noqa: BLE001
            tensors = []
        for name, value in attributes_of(module).items():
            if name not in ("_parameters", "_buffers", "_modules") and not isinstance(value, torch.nn.Module):
                tensors.extend(held_tensors(value))
        keys.update(storage_key(t)[0] for t in tensors)
    return frozenset(keys)


def layer_bytes(cache, exclude=frozenset()) -> dict:
    """``{label: bytes}`` held by each layer of ``cache`` (``cache_layers``), each counted without entering the
    cache, its halves or the other layers: a layer that keeps a reference to its cache (or a sibling) is not charged
    for what they hold, nor for a storage another layer reaches too (``cache_bytes`` counts those once, as the cache
    object's). ``exclude``: storage keys counted
    nowhere (``owned_by_model``)."""
    return _layer_storages(cache, exclude)[0]


def _layer_storages(cache, exclude) -> tuple[dict, set]:
    """``({label: bytes}, storage keys counted)`` of the layers of ``cache`` (``layer_bytes``)."""
    layers = cache_layers(cache)
    others = [cache, *(half for _, half in cache_halves(cache)), *(layer for _, layer in layers)]
    held = {label: held_storages(layer, skip=others, exclude=exclude) for label, layer in layers}
    reach: dict = {}
    for storages in held.values():
        for key in storages:
            reach[key] = reach.get(key, 0) + 1
    # a storage two layers reach (a page pool each layer holds directly) is no layer's own: counted once, as the
    # cache object's (cache_bytes), like a pool the layers reach through a back-reference to the cache
    per_layer = {label: sum(size for key, size in storages.items() if reach[key] == 1)
                 for label, storages in held.items()}
    counted = set(exclude) | {key for key, n in reach.items() if n == 1}
    return per_layer, counted


def cache_bytes(cache, exclude=frozenset()) -> tuple[dict, int]:
    """What a cache owns, each storage once: ``({label: bytes held by that layer}, shared)``. Each layer is counted
    without entering its cache, its halves or its siblings, and only for the storages no other layer reaches;
    ``shared`` is the bytes of every other storage reachable from the cache object — a page pool, block tables, free
    lists kept on the cache and reached by its layers through a back-reference, or held by each layer directly —
    that no single layer holds alone. Storages in ``exclude`` (the model's: ``owned_by_model``) are counted
    nowhere. A cache without readable layers is one pseudo-layer ``"cache"`` (``cache_layers``) and ``shared`` is 0.
    Never raises on a cache's shape."""
    per_layer, counted = _layer_storages(cache, exclude)
    if list(per_layer) == ["cache"] and cache_layers(cache)[0][1] is cache:
        return per_layer, 0
    return per_layer, sum(held_storages(cache, exclude=frozenset(counted)).values())


def largest_holdings(obj, n: int = 3) -> list:
    """``[(path, bytes, description)]`` of the ``n`` largest distinct storages ``obj`` holds, largest first
    (``description``: dtype and shape of the first tensor reached on it), for failure messages."""
    seen, rows = set(), []
    for path, t in held_tensor_items(obj):
        key, size = storage_key(t)
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
