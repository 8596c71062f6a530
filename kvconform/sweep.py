"""The survey behind ``--kvconform-model 'transformers:PATTERN'``: which architectures of the installed transformers
build tiny (``architectures.py``) and are causal language models that keep a cache, each with its reason if not.

Every architecture matching the pattern is built from its own config class, and is *refused* (listed, never run)
when building it raises or it is too large after the generic shrink, when its forward takes no cache at all
(``openai-gpt``, ``rwkv``: no KV cache to check), when it is not causal (the session's ``causality_gap`` check:
an encoder such as XLM registered as a causal LM, whose earlier positions see later tokens), when one cached
forward of its own (no cache passed, ``use_cache=True``) raises, or when its own code refuses any cache but its own
(MiniMax) or more than one new token into a warm cache (ProphetNet) (``_refuses_caches``). The others are run like
any model: their layer types decide which cases apply.

The verdicts depend only on the installed transformers and torch and on kvconform's builder, so they are kept in a
file under the system temp folder keyed by those versions and by the builder's source: pytest-xdist workers and
later runs read them instead of building 196 models again (a process builds a model again only when one of its
items needs it).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

SURVEY_VERSION = 2


def _cache_path() -> str:
    import torch
    import transformers

    from kvconform import architectures

    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in ("architectures.py", "sweep.py", "vision.py"):
        with open(os.path.join(here, name), "rb") as fh:
            digest.update(fh.read())
    digest.update(f"{transformers.__version__} {torch.__version__} {SURVEY_VERSION}".encode())
    del architectures
    return os.path.join(tempfile.gettempdir(), f"kvconform-architectures-{digest.hexdigest()[:16]}.json")


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(path: str, data: dict) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".kvconform-arch-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a cache only: the next process surveys again


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def reference_gap(config) -> str:
    """Why kvconform cannot judge caches on a model of ``config``: its decoder has layer types that kvconform's
    ``ReferenceCache`` does not model (``reference.unmodelled_layer_types``) — kvconform's own gap, named with the
    installed transformers, never a failure of a subject; ``""`` when there is none."""
    from kvconform.compat import transformers_version
    from kvconform.reference import unmodelled_layer_types

    try:
        missing = unmodelled_layer_types(config)
    except Exception as exc:  # noqa: BLE001 - layer types that cannot be read: the reference cannot be built either
        return f"kvconform's gap: the layer types of its cache cannot be read ({_first_line(exc)})"
    if not missing:
        return ""
    return (f"kvconform's gap: its layer type{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
            f"(transformers {transformers_version()}) {'have' if len(missing) > 1 else 'has'} no layer in "
            f"kvconform's ReferenceCache yet, so no cache can be judged on it; report it to kvconform's issue tracker")


def examine(model_type: str, causality_gap, tolerance: float) -> dict:
    """Build ``model_type`` tiny and judge it (module docstring). Returns ``{"model_type", "name", "built",
    "reason"}`` plus, when built, ``"layer_types"``, ``"accepts_position_ids"``, ``"params"`` and ``"gap"``.
    ``causality_gap``: ``session.causality_gap`` (a ``ZooModel`` → relative change of earlier logits)."""
    import torch

    from kvconform import architectures, zoo
    from kvconform.compat import accepts_position_ids, cache_kwarg

    record = {"model_type": model_type, "name": architectures.model_name(model_type), "built": False}
    spec = architectures.PREFIX + model_type
    try:
        zm = zoo.load_model(spec)
    except architectures.TooLarge as exc:
        return {**record, "reason": f"too large: {exc}"}
    except Exception as exc:  # noqa: BLE001 - every build failure is this architecture's reason
        return {**record, "reason": f"building it raised {_first_line(exc)}"}
    try:
        cache_kwarg(zm.model)
    except TypeError:
        return {**record, "reason": f"{type(zm.model).__name__}.forward takes no cache (no KV cache to check)"}
    unmodelled = reference_gap(zm.model.config)
    if unmodelled:
        return {**record, "reason": unmodelled}
    try:
        gap = causality_gap(zm)
    except Exception as exc:  # noqa: BLE001
        return {**record, "reason": f"its uncached forward raised {_first_line(exc)}"}
    if not gap <= tolerance:
        return {**record, "reason": f"not causal: changing later input tokens changed the logits of earlier "
                                    f"positions by {gap:.2g} (relative; a causal model: 0): a bidirectional "
                                    f"{type(zm.model).__name__}"}
    ids = torch.arange(3, 8).remainder(zm.vocab_size).unsqueeze(0)
    try:
        with torch.no_grad():
            out = zm.model(input_ids=ids, use_cache=True)
    except Exception as exc:  # noqa: BLE001
        return {**record, "reason": f"its own cached forward (no cache passed) raised {_first_line(exc)}"}
    refused = _refuses_caches(zm.model, out, ids)
    if refused:
        return {**record, "reason": refused}
    try:
        with torch.no_grad():
            zm.oracle_model()(input_ids=ids, use_cache=False)
    except Exception as exc:  # noqa: BLE001 - no float64 oracle, nothing to judge against
        return {**record, "reason": f"its float64 forward (kvconform's oracle) raised {_first_line(exc)}"}
    if zm.image is not None:  # a VLM: the uncached float64 forward of an image prompt is the oracle of its items
        from kvconform import vision

        image_ids = vision.with_image(zm.image, torch.full((1, zm.image.span + 2), 3, dtype=torch.long))
        try:
            with torch.no_grad():
                zm.oracle_model()(input_ids=image_ids, use_cache=False)
        except Exception as exc:  # noqa: BLE001
            return {**record, "reason": f"its float64 forward of an image prompt raised {_first_line(exc)}"}
        record["image"] = (f"image prefix: {zm.image.tokens} image tokens per "
                           f"{'×'.join(str(d) for d in zm.image.pixel_shape)} image")
    return {**record, "built": True, "reason": "", "layer_types": list(zm.layer_types),
            "accepts_position_ids": bool(accepts_position_ids(zm.model)),
            "params": int(sum(p.numel() for p in zm.model.parameters())), "gap": float(gap)}


_REFUSALS = (AssertionError, NotImplementedError, ValueError)
"""What a model's own code raises to refuse an input on purpose (an assert, a "not supported" error), as opposed to
a crash inside it (an IndexError, a shape mismatch), which is a finding to report, never a reason to refuse."""


def _refuses_caches(model, out, ids) -> str:
    """Why ``model``, whose cached forward of ``ids`` ``[1, 5]`` with no cache passed gave ``out``, cannot be checked
    with a cache of kvconform's choosing, or ``""``. Two refusals of the model's own code are reasons:

    * it takes only its own cache class: the cache it creates by itself is not a plain ``DynamicCache`` and a
      ``DynamicCache(config=...)`` passed in is refused (MiniMax's ``MiniMaxCache``: "uses cache of its own") or
      read for attributes only its own class has (transformers 5.5's OlmoHybrid: an ``AttributeError`` naming
      ``DynamicCache``; any other crash propagates);
    * its cached forward takes one new token at a time: 2 new tokens into its own warm cache are refused (ProphetNet
      asserts ``decoder_input_ids`` of length 1 once the cache holds tokens), so no prefill-then-chunk, fork or
      multi-turn case can run on it with any cache.
    """
    import torch
    from transformers import DynamicCache

    from kvconform.compat import cache_kwarg

    name = cache_kwarg(model)
    own = getattr(out, "past_key_values", None) or getattr(out, name, None)
    if own is not None and type(own) is not DynamicCache:
        try:
            with torch.no_grad():
                model(input_ids=ids, use_cache=True, **{name: DynamicCache(config=model.config)})
        except _REFUSALS as exc:
            return (f"takes only its own cache ({type(own).__name__}): its forward refuses a transformers "
                    f"DynamicCache ({_first_line(exc)})")
        except AttributeError as exc:
            if "'DynamicCache' object has no attribute" not in str(exc):
                raise
            # transformers 5.5's OlmoHybrid reads its own cache's conv_states_q off whatever cache it is given
            return (f"takes only its own cache ({type(own).__name__}): its forward reads attributes a transformers "
                    f"DynamicCache does not have ({_first_line(exc)})")
    if own is not None:
        try:
            with torch.no_grad():
                model(input_ids=ids[:, :2], use_cache=True, **{name: own})
        except _REFUSALS as exc:
            return (f"its cached forward takes one new token at a time: 2 new tokens into its own warm "
                    f"{type(own).__name__} are refused ({_first_line(exc)})")
        except Exception:  # noqa: BLE001 - a crash, not a refusal: the checks report it
            pass
    return ""


def survey(pattern: str, causality_gap, tolerance: float) -> list[dict]:
    """``examine`` every architecture matching ``pattern`` (``architectures.model_types``), reusing the verdicts
    stored for this transformers, torch and builder (module docstring). Records in model-type order.

    Raises:
        ValueError: the pattern matches no architecture.
    """
    import warnings

    from kvconform import architectures

    types = architectures.model_types(pattern)
    path = _cache_path()
    stored = _load(path)
    missing = [t for t in types if t not in stored]
    if missing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for model_type in missing:
                stored[model_type] = examine(model_type, causality_gap, tolerance)
        _store(path, {**_load(path), **stored})
    return [stored[t] for t in types]
