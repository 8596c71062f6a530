"""The ONLY module that knows which transformers version does what with caches.

Facts it encodes (measured on 5.5.4, 5.16.1 and 5.24.0; transformers changelogs):

* forward keyword of the cache: ``cache=`` since 5.24; before that ``past_key_values=`` for attention models and
  ``cache_params=`` for Mamba-style models. Detected from the forward signature, not the version, so models with
  their own modeling code (checkpoints with custom code) work too.
* the cache on the output: ``.cache`` since 5.24, ``.past_key_values`` / ``.cache_params`` before.
* ``generate``: takes the cache under the forward's keyword (``generate_cache_kwargs``); on 5.5.4 Mamba2's
  ``generate(past_key_values=...)`` is refused ("model_kwargs are not used by the model"), it wants ``cache_params``.
* static layers have ``crop`` since 5.24 (absent in 5.5.4 and 5.16.1: ``static_layers_crop``).
* ``crop``: since 5.14 ``crop(-n)`` removes n tokens (positive raises since 5.20, warned 5.16–5.18); before 5.14 the
  argument was the absolute length to keep (and ``crop(0)`` emptied the cache).
* ``get_max_length`` replaced ``get_max_cache_shape`` (read in the installed sources: on 5.5.4
  ``CacheLayerMixin.get_max_cache_shape`` is the abstract method and ``get_max_length`` does not exist; 5.16.1 has
  ``get_max_length`` abstract and ``get_max_cache_shape`` as a deprecated alias; 5.24.0 only ``get_max_length``); both
  are tried (``max_length``), and kvconform's own layers define both (``LAYER_MAX_LENGTH_METHODS``).
* linear-attention (SSM) layers: two protocols, see ``linear_attention_protocol`` (5.5.4 "single", 5.16.1 / 5.24.0
  "slots"); on 5.5.4 ``Cache`` has no ``activate_past_recording`` / ``is_croppable`` / ``get_conv_state``, and
  ``LinearAttentionCacheLayerMixin.crop`` is a silent no-op.
* the table of cache layer types (``DYNAMIC_LAYER_TYPE_MAPPING`` / ``STATIC_LAYER_TYPE_MAPPING``) and
  ``get_layer_types_and_kwargs`` exist in 5.16.1 and 5.24.0, not in 5.5.4 (there ``DynamicCache.__init__`` maps the
  types with an if/elif chain), see ``layer_type_mappings`` and ``layer_types_and_kwargs``.
* ``QuantizedCache`` (read from the released sources, replayed on 5.16.1): until 5.18 ``QuantizedLayer`` inherited
  ``DynamicLayer.reorder_cache``, which reorders only the exact residual, so after a residual flush the quantized part
  kept the old row order; 5.19 defers the reorder to the dequantized states. Until 5.17 ``reset()`` kept the
  quantized states; until 5.19 the flush ignored the chunk length (``len(residual) + 1 >= residual_length``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import weakref

_CACHE_KWARGS = ("cache", "past_key_values", "cache_params")


@functools.lru_cache(maxsize=None)
def transformers_version():
    """The installed transformers version as a ``packaging.version.Version``."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__)


_FORWARD_PARAMS: dict = {}  # model class → _forward_params (a forward set on the instance is read each time)


def _forward_params(model) -> tuple:
    """The parameter names of ``model.forward``; a forward taking ``**kwargs`` (a repository's own model class
    wrapping a transformers one) also gets those of the ``forward`` of its bases, which it forwards them to.
    Read once per model class (``inspect.signature`` on every forward call was a tenth of a faulty-cache run)."""
    cls = type(model)
    own = "forward" in vars(model)  # e.g. an offloading hook wraps the instance's forward
    if not own and cls in _FORWARD_PARAMS:
        return _FORWARD_PARAMS[cls]
    names = _read_forward_params(model)
    if not own:
        _FORWARD_PARAMS[cls] = names
    return names


def _read_forward_params(model) -> tuple:
    params = inspect.signature(model.forward).parameters
    names = list(params)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        for base in type(model).__mro__[1:]:
            if "forward" in vars(base):
                names += [n for n in inspect.signature(vars(base)["forward"]).parameters if n not in names]
    return tuple(names)


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


def encoder_kwargs(model, encoder_input) -> dict:
    """The keyword argument that gives ``model`` (a transformers encoder-decoder) its encoder input, on its device:
    token ids ``[B, S_enc]`` (int64) as ``input_ids``; float features (whisper's ``[B, mel, frames]``) under the
    model's ``main_input_name`` (``input_features``) in the dtype of its weights — float64 for the oracle's model,
    the case dtype for the cached run."""
    param = next(model.parameters())
    if encoder_input.is_floating_point():
        return {getattr(model, "main_input_name", "input_features"): encoder_input.to(param.device, param.dtype)}
    return {"input_ids": encoder_input.to(param.device)}


def accepts_position_ids(model) -> bool:
    """Whether the model's forward accepts ``position_ids`` counted from 0 (t5 and bart take none; RoBERTa-style
    models count positions from ``padding_idx + 1``, so explicit 0-based positions are another input than the
    uncached forward's own: measured once per model, ``positions_count_from_zero``)."""
    return "position_ids" in _forward_params(model) and positions_count_from_zero(model)


_FROM_ZERO: "weakref.WeakKeyDictionary" = None


def positions_count_from_zero(model) -> bool:
    """Whether ``model``'s own positions (no ``position_ids`` given) are ``0, 1, 2, ...``: the logits of 6 tokens
    with and without explicit ``position_ids = arange(6)`` agree (relative 1e-5). Measured once per model object;
    True when the forward cannot be run that way (an encoder-decoder: its items decide)."""
    import torch

    global _FROM_ZERO
    if _FROM_ZERO is None:
        _FROM_ZERO = weakref.WeakKeyDictionary()
    if model not in _FROM_ZERO:
        try:
            vocab = int(model.config.get_text_config(decoder=True).vocab_size)
            device = next(model.parameters()).device
            ids = (torch.arange(3, 9) % vocab).unsqueeze(0).to(device)
            with torch.no_grad():
                own = model(input_ids=ids, use_cache=False).logits.double()
                given = model(input_ids=ids, position_ids=torch.arange(6, device=device).unsqueeze(0),
                              use_cache=False).logits.double()
            _FROM_ZERO[model] = bool((own - given).abs().max() <= 1e-5 * max(1.0, float(own.abs().max())))
        except Exception:  # noqa: BLE001 - not runnable like this: decided by its items
            _FROM_ZERO[model] = True
    return _FROM_ZERO[model]


def output_cache(outputs):
    """The cache object returned on a model output (``.cache`` on ≥5.24)."""
    for name in _CACHE_KWARGS:
        value = getattr(outputs, name, None)
        if value is not None:
            return value
    return None


def generate_cache_kwargs(cache, model=None) -> dict:
    """Keyword arguments that hand ``cache`` to ``model.generate`` on the installed version.

    ``generate`` passes its model kwargs on to ``forward`` and refuses the ones forward does not take
    (``_validate_model_kwargs``), so the name is the forward's (``cache_kwarg``): ``cache=`` since 5.24; before,
    ``past_key_values=`` for attention models and ``cache_params=`` for Mamba / Mamba2 (read in 5.5.4, where
    ``generate(past_key_values=...)`` on Mamba2 raises "model_kwargs are not used by the model"). Without ``model``
    the attention models' name of the installed version is used.
    """
    if model is not None:
        return {cache_kwarg(model): cache}
    return {"cache": cache} if transformers_version().release >= (5, 24) else {"past_key_values": cache}


def crop(cache, tokens_to_remove: int, held: int | None = None) -> None:
    """Remove the last ``tokens_to_remove`` (≥ 0) tokens from ``cache`` with the installed version's contract.

    Before 5.14 the argument is the length to keep (what 5.5.4's own callers pass: ``generate`` and assisted decoding
    call ``crop(new_length)``); it is ``held - tokens_to_remove`` with ``held`` the tokens the caller knows the cache
    holds (as those callers do), else ``cache.get_seq_length()`` (which raises on an all-linear cache).
    """
    if transformers_version().release >= (5, 14):
        cache.crop(-int(tokens_to_remove))
    else:  # legacy contract: the argument is the length to keep
        length = int(cache.get_seq_length()) if held is None else int(held)
        cache.crop(max(length - int(tokens_to_remove), 0))


def tokens_removed_by_crop(argument: int, held: int | None) -> int | None:
    """How many tokens ``cache.crop(argument)`` removes from a cache holding ``held`` tokens under the installed
    version's contract (``crop``): from 5.14 the argument is minus the tokens to remove (0 removes none); before,
    the length to keep (a negative one counts from the end). None where ``held`` is needed and unknown."""
    argument = int(argument)
    if transformers_version().release >= (5, 14) or argument < 0:
        return max(-argument, 0) if argument <= 0 else None
    return None if held is None else max(int(held) - argument, 0)


LAYER_MAX_LENGTH_METHODS = ("get_max_length", "get_max_cache_shape")
"""The names under which a cache *layer* reports its capacity: ``get_max_length`` (abstract in
``CacheLayerMixin`` since 5.16.1 at the latest; 5.24.0) and ``get_max_cache_shape`` (abstract on 5.5.4). A layer
class of kvconform defines both, so it can be instantiated on every supported release."""


def max_length_name() -> str:
    """The name callers of the installed release use for a cache's capacity: ``"get_max_length"`` (5.16.1, 5.24.0)
    or ``"get_max_cache_shape"`` (5.5.4, where ``Cache`` has no ``get_max_length``)."""
    from transformers import Cache

    return "get_max_length" if hasattr(Cache, "get_max_length") else "get_max_cache_shape"


def max_length(cache) -> int:
    """``cache.get_max_length()`` (``get_max_cache_shape()`` on older releases) of a cache or a cache layer; −1
    means unbounded.

    Raises:
        AttributeError: the object has neither method.
    """
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


def crop_tokens_to_remove(argument: int, held) -> int:
    """How many tokens ``cache.crop(argument)`` must remove under the installed release's contract (≥ 0).

    * since 5.20: ``argument`` must be ≤ 0 and ``-argument`` tokens are removed; a positive one raises.
    * 5.14–5.19: negative as above; a positive one is still the legacy length to keep (warned 5.16–5.18).
    * before 5.14 (read in 5.5.4 ``DynamicLayer.crop(max_length)``): ``argument ≥ 0`` is the length to keep (so
      ``crop(0)`` empties the cache, and a length ≥ the held one is a no-op); a negative one removes ``-argument``.

    Args:
        argument: what the caller passed to ``crop``.
        held: a zero-argument callable returning the tokens held; only called for a length-to-keep argument.

    Raises:
        ValueError: a positive argument where the installed release refuses it (≥ 5.20).
    """
    argument, contract = int(argument), positive_crop_contract()
    if argument < 0 or (argument == 0 and contract != "keep-zero-empties"):
        return -argument
    if contract == "raise":
        raise ValueError(
            f"crop({argument}): pass a negative count of tokens to remove, e.g. crop(-3); "
            "positive values (the legacy 'final length' meaning) are not accepted since transformers 5.20"
        )
    return max(int(held()) - argument, 0)


def positive_crop_contract() -> str:
    """What ``crop(n)`` with ``n ≥ 0`` means on the installed transformers: ``"raise"`` for ``n > 0`` (≥ 5.20: only
    negative counts; ``crop(0)`` is a no-op), ``"keep"`` (5.14–5.19: ``n > 0`` is the length to keep, ``crop(0)`` a
    no-op) or ``"keep-zero-empties"`` (before 5.14, read in 5.5.4: ``n ≥ 0`` is the length to keep, so ``crop(0)``
    empties the cache). Source: transformers changelogs 5.14–5.20 and the 5.5.4 / 5.16.1 / 5.24.0 sources."""
    release = transformers_version().release
    if release >= (5, 20):
        return "raise"
    return "keep" if release >= (5, 14) else "keep-zero-empties"


def static_layers_crop() -> bool:
    """Whether the installed static layers (``StaticLayer``, ``StaticSlidingWindowLayer``) implement ``crop``. They do
    since 5.24 (measured); on 5.5.4 and 5.16.1 (read in the sources) they have no ``crop``, so ``StaticCache.crop``,
    inherited from ``Cache``, can only raise ``AttributeError``: static caches cannot be cropped there."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    return hasattr(StaticLayer, "crop") and hasattr(StaticSlidingWindowLayer, "crop")


@functools.lru_cache(maxsize=None)
def linear_attention_protocol() -> str:
    """How the installed models talk to a linear-attention (SSM) cache layer: ``"slots"`` or ``"single"``.

    * ``"slots"`` (5.16.1, 5.24.0): a layer holds ``number_of_states`` (conv, recurrent) pairs, its attributes
      ``conv_states`` / ``recurrent_states`` / ``has_previous_state`` are dicts keyed by ``state_idx``; the prefill
      hands the raw conv input to ``update_conv_state(x, state_idx, conv_kernel_size=K)``, which returns it with its
      left context prepended; single-token decode reads ``Cache.get_conv_state`` / ``get_recurrent_state`` and
      updates those tensors in place; ``activate_past_recording`` makes crop possible.
    * ``"single"`` (5.5.4): one pair per layer; ``conv_states`` / ``recurrent_states`` are tensors read directly
      (``cache.layers[i].recurrent_states``, ``cache.layers[i].device``) and ``has_previous_state`` is a bool; the
      prefill pads or truncates the conv input to exactly ``K`` columns itself before ``update_conv_state(x)``; later
      steps pass only the new inputs, and ``update_conv_state`` must return the last ``K``; no ``state_idx``, no
      past recording.

    Detected from the installed ``LinearAttentionCacheLayerMixin.update_conv_state`` signature (``state_idx``), not
    from the version number.
    """
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    params = inspect.signature(LinearAttentionCacheLayerMixin.update_conv_state).parameters
    return "slots" if "state_idx" in params else "single"


def run_bookkeeping_init(base: type, layer, **kwargs) -> None:
    """Run ``base.__init__`` (a transformers cache-layer mixin) on ``layer``, if ``base`` defines one: the fields the
    installed release keeps its books in (counters, ``record_past``, ``device`` / ``dtype``, ...). A mixin without
    an ``__init__`` of its own (``object.__init__`` takes no arguments) is skipped."""
    if "__init__" in vars(base):
        base.__init__(layer, **kwargs)


def count_linear_tokens(layer, tokens: int | None) -> None:
    """Keep a linear-attention layer's own token counter, where the installed release has one, in step with
    ``tokens`` conv inputs added (negative: removed by a crop; None: reset to 0).

    5.25 counts a linear layer's tokens in the layer (``cumulative_length_linear``, a 0-d int64 tensor that its
    mixin's ``get_seq_length`` returns and ``increase_count`` / ``crop`` / ``reset`` keep) but advances it *inside*
    ``LinearAttentionLayer.update_conv_state``, a storage method the reference replaces; this is that one line.
    Releases without the counter (≤ 5.24) have nothing to keep.
    """
    counter = getattr(layer, "cumulative_length_linear", None)
    if not hasattr(counter, "zero_"):  # no counter (or not a tensor): nothing to keep
        return
    if tokens is None:
        counter.zero_()
    else:
        counter.add_(tokens)


@functools.lru_cache(maxsize=None)
def records_recurrent_states() -> bool:
    """Whether the installed linear-attention layers can record recurrent states for ``crop``
    (``activate_past_recording(recurrent_states_to_keep=N)``, 5.25 and later), read off the signature."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    method = getattr(LinearAttentionCacheLayerMixin, "activate_past_recording", None)
    return method is not None and "recurrent_states_to_keep" in inspect.signature(method).parameters


def layer_type_mappings():
    """``(DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING)`` of the installed transformers (layer type name →
    layer class), or None where the release has no such table (5.5.4: the types are mapped by an if/elif chain inside
    ``DynamicCache.__init__`` / ``StaticCache.__init__``, so there is no list of supported types to cover)."""
    import transformers.cache_utils as cu

    dyn = getattr(cu, "DYNAMIC_LAYER_TYPE_MAPPING", None)
    sta = getattr(cu, "STATIC_LAYER_TYPE_MAPPING", None)
    return None if dyn is None or sta is None else (dyn, sta)


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


# ------------------------------------------------------------------------------------------ optional packages
@functools.lru_cache(maxsize=None)
def missing_requirement(requirement: str) -> bool:
    """True when ``requirement`` — ``"module"`` or ``"module:attr"`` — is not importable here.

    Modules are located without importing them (``importlib.util.find_spec``); an ``attr`` needs the import.
    """
    module, _, attr = requirement.partition(":")
    try:
        if importlib.util.find_spec(module) is None:
            return True
    except (ImportError, ValueError):
        return True
    if not attr:
        return False
    try:
        return not hasattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001 - a module that fails to import is missing
        return True


# ------------------------------------------------------------------------------------------ devices
_PLANNED_AS_CUDA = [False]


def cuda_available() -> bool:
    """Whether CUDA runs here: ``torch.cuda.is_available()``, or True inside ``planned_as_cuda()`` (a plan made on a
    machine without a GPU, to see what a GPU run would plan, skip and judge; nothing runs under it). Every CUDA rule
    of the plan and the checks asks this one function."""
    if _PLANNED_AS_CUDA[0]:
        return True
    import torch

    return bool(torch.cuda.is_available())


def on_cuda(device) -> bool:
    """Whether ``device`` (a torch device or its name) is a CUDA device that runs here (``cuda_available``)."""
    return str(device).startswith("cuda") and cuda_available()


class planned_as_cuda:
    """Context manager: within it ``cuda_available()`` answers True, so ``plan.skip_reason`` and the checks' CUDA
    rules decide items as on a GPU. For planning only (``kvconform-device-check --smoke``, the planning tests): no
    item may run under it."""

    def __enter__(self):
        self._was = _PLANNED_AS_CUDA[0]
        _PLANNED_AS_CUDA[0] = True
        return self

    def __exit__(self, *exc):
        _PLANNED_AS_CUDA[0] = self._was
        return False


def settle_streams(device) -> None:
    """Wait for every CUDA stream of ``device`` (``torch.cuda.synchronize``), a no-op elsewhere: an offloaded cache
    moves its layers with ``non_blocking`` copies on a prefetch stream, so its tensors may be read only after them."""
    if str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize(device)


def strict_float32(device) -> None:
    """On CUDA, turn TF32 off for matmuls and cuDNN (``torch.backends``) so that float32 computes in float32: the
    float32 tolerances (``oracle.DTYPE_TOLERANCE``) are calibrated on float32 arithmetic, and TF32's 10-bit mantissa
    would move an exact cache's error by ~1e-3. A no-op elsewhere."""
    if str(device).startswith("cuda"):
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")


def missing_tool(tool: str) -> bool:
    """True when the program ``tool`` is neither on ``PATH`` nor in ``$CUDA_HOME/bin`` (``$CUDA_PATH/bin``): e.g.
    ``nvcc``, which optimum-quanto needs to build its CUDA kernels on first use."""
    import os
    import shutil

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or ""
    return not (shutil.which(tool) or (home and os.path.exists(os.path.join(home, "bin", tool))))


POSITION_KEYS = ("max_target_positions", "n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length",
                 "max_seq_len", "seq_length")
"""Config attributes that give a model's number of positions, in the order they are read (an encoder-decoder's
decoder table first: Whisper's ``max_target_positions``)."""

ROTARY_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim", "rotary_pct", "rotary_emb_base",
               "partial_rotary_factor")
"""Config attributes of rotary position embeddings: a model that has one computes positions, it has no table."""


def position_limit(config) -> int | None:
    """The position count a model's ``config`` declares (its text config for a vision-language model), or None:
    the first of ``POSITION_KEYS`` (``n_positions`` of GPT-2, ``max_position_embeddings`` of BART), unless the config
    declares rotary embeddings (``ROTARY_KEYS``), relative attention buckets (T5) or a non-absolute
    ``position_embedding_type``: such a model computes its positions, and its ``max_position_embeddings`` is a
    training length, not a limit. A candidate only: ``plan.position_limit`` keeps it where the model has a learned
    table of that many rows (Jamba declares 512 positions and has no table)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for cfg in (text, config):
        if any(getattr(cfg, key, None) is not None for key in ROTARY_KEYS):
            return None
        if getattr(cfg, "relative_attention_num_buckets", None) is not None:
            return None
        if getattr(cfg, "position_embedding_type", "absolute") not in ("absolute", None):
            return None
    for key in POSITION_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
