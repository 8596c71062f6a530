"""The ONLY module that knows which transformers version does what with caches.

Facts it encodes (``shared/FACTS.md``, measured; transformers changelogs):

* forward keyword of the cache: ``cache=`` since 5.24; before that ``past_key_values=`` for attention models and
  ``cache_params=`` for Mamba-style models. Detected from the forward signature, not the version, so models with
  their own modeling code (checkpoints with custom code) work too.
* the cache on the output: ``.cache`` since 5.24, ``.past_key_values`` / ``.cache_params`` before.
* ``crop``: since 5.14 ``crop(-n)`` removes n tokens (positive raises since 5.20, warned 5.16–5.18); before 5.14 the
  argument was the absolute length to keep (and ``crop(0)`` emptied the cache).
* ``get_max_length`` replaced ``get_max_cache_shape`` in 5.x; both are tried.
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
