"""The ONLY module that knows which transformers version does what with caches.

Facts it encodes (``shared/FACTS.md``, measured; transformers changelogs):

* forward keyword of the cache: ``cache=`` since 5.24; before that ``past_key_values=`` for attention models and
  ``cache_params=`` for Mamba-style models. Detected from the forward signature, not the version, so models with
  their own modeling code (checkpoints with custom code) work too.
* the cache on the output: ``.cache`` since 5.24, ``.past_key_values`` / ``.cache_params`` before.
* ``crop``: since 5.14 ``crop(-n)`` removes n tokens (positive raises since 5.20, warned 5.16–5.18); before 5.14 the
  argument was the absolute length to keep (and ``crop(0)`` emptied the cache).
* ``get_max_length`` replaced ``get_max_cache_shape`` in 5.x; both are tried.
* ``QuantizedCache`` (read from the released sources, replayed on 5.16.1): until 5.18 ``QuantizedLayer`` inherited
  ``DynamicLayer.reorder_cache``, which reorders only the exact residual, so after a residual flush the quantized part
  kept the old row order; 5.19 defers the reorder to the dequantized states. Until 5.17 ``reset()`` kept the
  quantized states; until 5.19 the flush ignored the chunk length (``len(residual) + 1 >= residual_length``).
"""

from __future__ import annotations

import functools
import inspect

_CACHE_KWARGS = ("cache", "past_key_values", "cache_params")


@functools.lru_cache(maxsize=None)
def transformers_version():
    """The installed transformers version as a ``packaging.version.Version``."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__)


def _forward_params(model) -> tuple:
    return tuple(inspect.signature(model.forward).parameters)


def cache_kwarg(model) -> str:
    """Name of the forward keyword that takes the cache object for ``model`` (``"cache"`` on transformers ≥5.24).

    Raises:
        TypeError: the model's forward takes no cache at all.
    """
    params = _forward_params(model)
    for name in _CACHE_KWARGS:
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes none of {_CACHE_KWARGS}: it cannot use a cache")


def accepts_position_ids(model) -> bool:
    """Whether the model's forward accepts ``position_ids`` (t5 and bart do not)."""
    return "position_ids" in _forward_params(model)


def output_cache(outputs):
    """The cache object returned on a model output (``.cache`` on ≥5.24)."""
    for name in _CACHE_KWARGS:
        value = getattr(outputs, name, None)
        if value is not None:
            return value
    return None


def generate_cache_kwargs(cache) -> dict:
    """Keyword arguments that hand ``cache`` to ``model.generate`` on the installed version."""
    return {"cache": cache} if transformers_version().release >= (5, 24) else {"past_key_values": cache}


def crop(cache, tokens_to_remove: int) -> None:
    """Remove the last ``tokens_to_remove`` (≥ 0) tokens from ``cache`` with the installed version's contract."""
    if transformers_version().release >= (5, 14):
        cache.crop(-int(tokens_to_remove))
    else:  # legacy contract: the argument is the length to keep
        cache.crop(max(cache.get_seq_length() - int(tokens_to_remove), 0))


def max_length(cache) -> int:
    """``cache.get_max_length()`` (``get_max_cache_shape()`` on older releases); −1 means unbounded."""
    fn = getattr(cache, "get_max_length", None) or getattr(cache, "get_max_cache_shape")
    value = fn()
    return -1 if value is None else int(value)


def prepare_float64(model):
    """Make a float64 copy of a model runnable: MoE experts use torch's grouped_mm by default on 5.x, which rejects
    float64, so the oracle copy switches to the eager experts implementation where the model has one."""
    setter = getattr(model, "set_experts_implementation", None)
    if setter is not None:
        try:
            setter("eager")
        except (ValueError, AttributeError):  # the model has no experts
            pass
    return model


def quantized_reorder_fixed() -> bool:
    """Whether the installed ``QuantizedCache`` reorders its quantized part on ``reorder_cache`` (5.19 and later)."""
    return transformers_version().release >= (5, 19)


def layer_types_and_kwargs(config) -> tuple[list, list]:
    """Per decoder layer: the cache layer type (``"full_attention"``, ``"sliding_attention"``,
    ``"linear_attention"``, ``"hybrid"``, ...) and the keyword arguments its cache layer needs.

    Uses ``transformers.cache_utils.get_layer_types_and_kwargs`` where it exists (5.2x). Older releases have no
    such function: there the answer is read off a real ``DynamicCache(config=config)`` of the installed version,
    so it is whatever that version's own cache would build.
    """
    import transformers.cache_utils as cu

    decoder = config.get_text_config(decoder=True)
    if hasattr(cu, "get_layer_types_and_kwargs"):
        types, kwargs = cu.get_layer_types_and_kwargs(decoder)
        if isinstance(kwargs, dict):  # up to 5.1x: one kwargs dict shared by every layer
            return list(types), [dict(kwargs) for _ in types]
        return list(types), list(kwargs)
    names = {"DynamicLayer": "full_attention", "DynamicSlidingWindowLayer": "sliding_attention",
             "LinearAttentionLayer": "linear_attention", "LinearAttentionAndFullAttentionLayer": "hybrid"}
    types, kwargs = [], []
    for layer in cu.DynamicCache(config=decoder).layers:
        kind = names.get(type(layer).__name__, "full_attention")
        types.append(kind)
        extra = {"sliding_window": layer.sliding_window} if kind == "sliding_attention" else {}
        if kind in ("linear_attention", "hybrid"):
            extra["number_of_states"] = getattr(layer, "number_of_states", 1)
        kwargs.append(extra)
    return types, kwargs
