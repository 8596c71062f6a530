"""Family ``logits``, real growth steps: lengths across power-of-two steps (up to 1,024 and 2,048 tokens) on a
one-layer copy of the model, so a buffer that grows at a real step (nanochat grows by 1,024) is grown and read.

The zoo's cases hold at most a few hundred tokens; a cache whose buffers grow by 1,024 never grows there. The copy
keeps the model's first decoder layer only (its embeddings, norm and head unchanged), so a forward over 2,048 tokens
costs about a two-layer model's over 1,000; its oracle is the same copy's float64 uncached forward. A model without a
``model.layers`` list (or whose positions are a learned table shorter than the case) is skipped with the reason.
"""

from __future__ import annotations

from kvconform.checks import OP_PARAMS, OpRule, register
from kvconform.checks._diagnosis import fail_verdict, run_on_variant
from kvconform.checks._judge import record_verdict
from kvconform.outcomes import CheckSkipped

_VARIANTS: dict = {}
"""``id of the model → (ZooModel copy, Oracle) or the reason there is none``: one copy per model, per process."""


def one_layer_variant(zm):
    """``(ZooModel, Oracle)`` of a copy of ``zm`` (a ``ZooModel``) keeping only its first decoder layer (config
    ``num_hidden_layers = 1``, ``layer_types`` cut to one), built once per process; or a ``str``: why there is none
    (no ``model.layers`` list, an encoder-decoder model)."""
    import copy
    import dataclasses

    import torch

    from kvconform.oracle import Oracle
    from kvconform.zoo import _layer_types

    key = id(zm.model)
    if key in _VARIANTS:
        return _VARIANTS[key]
    inner = getattr(zm.model, "model", None)
    layers = getattr(inner, "layers", None)
    if zm.is_encoder_decoder or not isinstance(layers, torch.nn.ModuleList) or len(layers) < 1:
        _VARIANTS[key] = f"{zm.name} has no decoder layer list (model.layers) to cut to one layer"
        return _VARIANTS[key]
    model = copy.deepcopy(zm.model)
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:1])
    config = model.config
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:1]
    types, window = _layer_types(config)
    variant = dataclasses.replace(zm, model=model, config=config, _oracle_model=None, layer_types=types,
                                  sliding_window=window)
    _VARIANTS[key] = (variant, Oracle(variant))
    return _VARIANTS[key]


def _cause(steps):
    def cause(step, cmp):
        good = step.start
        crossed = [2 ** k for k in range(4, 13) if step.start < 2 ** k <= step.start + step.length]
        if crossed or good >= 1024:
            return (f"correct for the first {good} positions, wrong from position {good}, once the cache holds more "
                    f"than {max((2 ** k for k in range(4, 13) if 2 ** k <= good + step.length - 1), default=good)} "
                    f"tokens: a buffer grown at that step does not keep its tokens in place (Tensor.resize_ keeps the "
                    f"flat storage, so every (row, head) but (0, 0) moves: nanochat #187) — allocate the larger "
                    f"buffer and copy the held tokens into it")
        return (f"correct for the first {good} positions, wrong from position {good}: the cache loses or misplaces "
                f"tokens below its first growth step")
    return cause


@register("logits", reads_position_ids=True, needs=("forward",), params=OP_PARAMS, cost=4.0,
          ops=OpRule(first="prefill", why="it compares every step after a prefill"))
def check_growth_steps(ctx):
    """A one-layer copy of the model driven across power-of-two lengths (past 1,024 and 2,048 tokens): every step's
    logits equal the copy's oracle."""
    found = one_layer_variant(ctx.model)
    if isinstance(found, str):
        raise CheckSkipped(found)
    variant, oracle = found
    vctx, cache, steps, verdict = run_on_variant(ctx, variant, oracle)
    record_verdict(vctx, verdict, len(steps), held=steps[-1].start + steps[-1].length if steps else 0)
    if not verdict.passed:
        fail_verdict(vctx, verdict, _cause(steps))
