"""Family ``logits``, zero data: a copy of the model with one token's embedding row zeroed, fed that token at chosen
positions, must give the oracle's logits of that same copy.

On a model whose first attention layer has no bias and no position embedding added to the input (llama, mistral,
gemma2, gemma3, phi3 of the zoo; not qwen2, whose k/v projections have a bias, nor gpt2, which adds learned
positions), the zeroed token's keys and values at layer 0 are then exactly zero: RMSNorm of a zero vector is zero, a
bias-free projection of it too, and so is RoPE of it. A random seeded model never writes a zero key row; a real
checkpoint does (a padding or reserved token whose embedding is all zeros). A cache that infers anything from its
contents — a length counted as the slots whose key is non-zero (transformers #30377: ``StaticCache.get_seq_length``
did exactly that), an "empty slot" test, a scale computed from a zero block — is wrong only then.
"""

from __future__ import annotations

import dataclasses

from kvconform.checks import OP_PARAMS, OpRule, Param, register
from kvconform.checks._drive import SubjectRaised
from kvconform.checks._diagnosis import fail_raised, fail_verdict
from kvconform.checks._interpreter import Runner
from kvconform.checks._judge import judge, record_verdict
from kvconform.checks._measure import layer_list, self_half

_VARIANTS: dict = {}
"""``(id of the model, token) → (ZooModel copy, Oracle)``: one zeroed copy per model and token, per process."""


def zeroed_variant(zm, token: int):
    """``(ZooModel, Oracle)`` of a copy of ``zm`` (a ``ZooModel``) whose input embedding row ``token`` is all zeros
    (built once per process; the original model is untouched).

    Raises:
        ValueError: ``token`` outside the model's embedding table.
    """
    import copy

    import torch

    from kvconform.oracle import Oracle

    key = (id(zm.model), token)
    if key not in _VARIANTS:
        model = copy.deepcopy(zm.model)
        table = model.get_input_embeddings().weight
        if not 0 <= token < table.shape[0]:
            raise ValueError(f"token {token} is outside the embedding table ({table.shape[0]} rows)")
        with torch.no_grad():
            table[token].zero_()
        variant = dataclasses.replace(zm, model=model, _oracle_model=None)
        _VARIANTS[key] = (variant, Oracle(variant))
    return _VARIANTS[key]


class _ZeroTokenRunner(Runner):
    """A runner whose random tokens are ``token`` at the absolute positions ``positions``."""

    def __init__(self, ctx, cache, token: int, positions, **kwargs):
        super().__init__(ctx, cache, **kwargs)
        self.token, self.positions = token, set(positions)

    def _new_tokens(self, n):
        new, mask = super()._new_tokens(n)
        for pos in range(self.length, self.length + n):
            if pos in self.positions:
                new[:, pos - self.length] = self.token
        return new, mask


def zero_key_rows(cache, held: int) -> list[int]:
    """Positions below ``held`` whose keys (row 0, head 0) at the first attention layer are exactly zero (what a cache
    that judges slots by their contents would see), or ``[]``."""
    for layer in layer_list(self_half(cache)):
        keys = getattr(layer, "keys", None)
        if keys is None or getattr(keys, "dim", lambda: 0)() != 4:
            continue
        try:
            return [int(i) for i in (keys[0, 0, :held].abs().sum(-1) == 0).nonzero().flatten().tolist()]
        except Exception:  # noqa: BLE001 - a layer whose keys cannot be read element-wise: not measured
            return []
    return []


def _cause(token, positions, steps, cache):
    def cause(step, cmp):
        for s in steps[: step.index + 1]:
            fed = s.start + s.length
            if s.reported_length is not None and s.reported_length != fed:
                return (f"get_seq_length() returned {s.reported_length} after {fed} tokens were fed (at {s.label}): "
                        f"the length is counted from the cache's contents, and token {token} (at positions "
                        f"{sorted(positions)}) has all-zero keys at layer 0, so its slots count as empty "
                        f"(transformers #30377) — keep a counter of the tokens written instead")
        return (f"the cache treats token {token}'s all-zero keys/values (positions {sorted(positions)}, layer 0) as "
                f"something else than data: an emptiness test, a scale or a norm computed from them")
    return cause


TOKEN = Param(int, default=5, min=3, doc="the token whose embedding row is zeroed (not a special id 0-2)")
POSITIONS = Param(list, default=[0, 3, 7, 12], items=int, min=0, doc="absolute positions fed that token")


@register("logits", reads_position_ids=True, needs=("forward",),
          params={**OP_PARAMS, "token": TOKEN, "positions": POSITIONS},
          ops=OpRule(first="prefill", why="it compares every step after a prefill"))
def check_zero_key_rows(ctx):
    """A copy of the model with one token's embedding row zeroed (exactly zero keys/values at layer 0 on bias-free
    models), fed that token at ``positions``: every step's logits equal the oracle of that copy."""
    token, positions = ctx.case.params["token"], ctx.case.params["positions"]
    variant, oracle = zeroed_variant(ctx.model, token)
    vctx = ctx.replace(model=variant, oracle=oracle)
    cache = vctx.new_cache()
    runner = _ZeroTokenRunner(vctx, cache, token, positions)
    try:
        steps = runner.run()
    except SubjectRaised as exc:
        fail_raised(vctx, exc, "the cache does not support this sequence of calls (see the exception)")
    zero = zero_key_rows(cache, steps[-1].start + steps[-1].length if steps else 0)
    verdict = judge(vctx, steps, driver=lambda c, k: _ZeroTokenRunner(c, k, token, positions).run())
    record_verdict(vctx, verdict, len(steps), zero_key_positions=zero)
    if not verdict.passed:
        fail_verdict(vctx, verdict, _cause(token, positions, steps, cache),
                     driver=lambda c, k: _ZeroTokenRunner(c, k, token, positions).run())
