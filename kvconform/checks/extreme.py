"""Family ``logits``, zero and extreme data (``check_zero_key_rows``, ``check_fp16_extreme``).

Zero data: a copy of the model with one token's embedding row zeroed, fed that token at chosen
positions, must give the oracle's logits of that same copy.

On a model whose first attention layer has no bias and no position embedding added to the input (llama, mistral,
gemma2, gemma3, phi3 of the zoo; not qwen2, whose k/v projections have a bias, nor gpt2, which adds learned
positions), the zeroed token's keys and values at layer 0 are then exactly zero: RMSNorm of a zero vector is zero, a
bias-free projection of it too, and so is RoPE of it. A random seeded model never writes a zero key row; a real
checkpoint does (a padding or reserved token whose embedding is all zeros). A cache that infers anything from its
contents — a length counted as the slots whose key is non-zero (transformers #30377: ``StaticCache.get_seq_length``
did exactly that), an "empty slot" test, a scale computed from a zero block — is wrong only then.

Extreme data: a float16 case on a copy of the model whose keys and values reach ~2e4 (``scaled_variant``: the key and
value projections scaled up, the query and output projections down by the same factors, so the logits are the same in
exact arithmetic and the float64 oracle stays finite). Zoo activations are ~1, far from float16's 65504; a cache that
computes a scale, a norm or a range in the 16-bit dtype (vLLM #53334, kvpress #250) overflows only here.
"""

from __future__ import annotations

import dataclasses
import math

from kvconform.checks import OP_PARAMS, OpRule, Param, register
from kvconform.checks._drive import SubjectRaised
from kvconform.checks._diagnosis import fail_raised, fail_verdict, run_on_variant
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
    from kvconform.outcomes import CheckSkipped

    if ctx.model.image is not None:
        raise CheckSkipped(f"{ctx.model.name} is a vision-language model: its prompts start with an image block, "
                           f"which a token placed at the case's positions would cut")
    if not hasattr(ctx.model.model, "get_input_embeddings"):
        raise CheckSkipped(f"{ctx.model.name} has no get_input_embeddings(): kvconform zeroes a row of a transformers "
                           f"model's input embeddings, which a model written from scratch does not expose")
    token, positions = ctx.case.params.token, ctx.case.params.positions
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


# ------------------------------------------------------------------------------------------------ the float16 range
_SCALED: dict = {}
"""``(id of the model, magnitude) → (ZooModel copy, Oracle, {layer: (k scale, v scale)})`` or the reason there is
none, per process."""


def _attentions(model) -> list:
    """The modules of ``model`` with ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` linear projections."""
    import torch

    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    return [m for m in model.modules() if all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in names)]


def scaled_variant(zm, magnitude: float):
    """A copy of ``zm`` whose keys and values reach ``magnitude`` in absolute value with the same logits in exact
    arithmetic: at every attention layer with ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` (llama, mistral,
    qwen2, phi3-style modules), ``k_proj`` is multiplied by ``s_k`` and ``q_proj`` divided by it (the scores stay the
    same), ``v_proj`` multiplied by ``s_v`` and ``o_proj`` divided by it (the output stays the same), ``s`` chosen from
    the magnitudes a 32-token seeded prompt gives that layer. Returns ``(ZooModel, Oracle, {layer: (s_k, s_v)})``, or
    a ``str``: why there is none (no such projections)."""
    import copy
    import dataclasses

    import torch

    from kvconform.oracle import Oracle

    key = (id(zm.model), magnitude)
    if key in _SCALED:
        return _SCALED[key]
    attns = _attentions(zm.model)
    if not attns:
        _SCALED[key] = f"{zm.name} has no attention with q_proj / k_proj / v_proj / o_proj projections to scale"
        return _SCALED[key]
    seen: dict = {}
    hooks = [getattr(m, n).register_forward_hook(
        lambda mod, args, out, i=i, n=n: seen.__setitem__((i, n), float(out.detach().float().abs().amax())))
        for i, m in enumerate(attns) for n in ("k_proj", "v_proj")]
    try:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, zm.vocab_size, (1, 32), generator=gen)
        with torch.no_grad():
            zm.model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    model = copy.deepcopy(zm.model)
    copies = _attentions(model)
    scales = {}
    with torch.no_grad():
        for i, m in enumerate(copies):
            sk = magnitude / max(seen.get((i, "k_proj"), 0.0), 1e-6)
            sv = magnitude / max(seen.get((i, "v_proj"), 0.0), 1e-6)
            for proj, factor in ((m.k_proj, sk), (m.q_proj, 1 / sk), (m.v_proj, sv)):
                proj.weight.mul_(factor)
                if proj.bias is not None:
                    proj.bias.mul_(factor)
            m.o_proj.weight.div_(sv)
            scales[i] = (sk, sv)
    variant = dataclasses.replace(zm, model=model, _oracle_model=None)
    _SCALED[key] = (variant, Oracle(variant), scales)
    return _SCALED[key]


def _largest(cache) -> float:
    """The largest finite ``|key|`` or ``|value|`` the cache's layers give back (0.0 when none are readable)."""
    import torch

    out = 0.0
    for layer in layer_list(self_half(cache)):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                finite = t.detach().float()
                finite = finite[torch.isfinite(finite)]
                if finite.numel():
                    out = max(out, float(finite.abs().amax()))
    return out


MAGNITUDE = Param(float, default=2e4, min=1.0, max=6e4,
                  doc="largest |key| / |value| the scaled copy reaches (float16's largest finite value is 65504)")


def _needs_half(case):
    if case.dtype not in ("float16", "bfloat16"):
        return "dtype", (f"check_fp16_extreme scales activations toward the top of a 16-bit range: dtype = "
                         f'"float16" (or "bfloat16"); got {case.dtype!r}')
    return None


@register("logits", reads_position_ids=True, needs=("forward",), params={**OP_PARAMS, "magnitude": MAGNITUDE},
          ops=OpRule(first="prefill", why="it compares every step after a prefill"), validate=_needs_half)
def check_fp16_extreme(ctx):
    """A copy of the model whose keys and values reach ``magnitude`` (2e4 by default, near float16's 65504) with
    the same exact-arithmetic logits: every step's logits are finite and equal that copy's float64 oracle."""
    found = scaled_variant(ctx.model, ctx.case.params.magnitude)
    if isinstance(found, str):
        from kvconform.outcomes import CheckSkipped

        raise CheckSkipped(found)
    variant, oracle, scales = found
    vctx, cache, steps, verdict = run_on_variant(ctx, variant, oracle)
    largest = _largest(cache)
    record_verdict(vctx, verdict, len(steps), largest_kv=largest)
    if verdict.passed:
        return
    step, cmp = verdict.first_fail  # set where the verdict did not pass
    magnitude = ctx.case.params.magnitude
    observed = f"{cmp.max_abs:.1e}" if math.isfinite(cmp.max_abs) else "NaN/inf"
    bound = (f"≤ {cmp.tol:.1e} ({vctx.tolerance().describe(cmp.floor)})" if math.isfinite(cmp.tol)
             else "finite (the comparison target is not finite either)")
    vctx.fail([f"max|Δlogit| = {observed}{vctx.kind.versus}, but should be {bound}",
               f"ops: {ctx.case.ops_label()}   [failed at {step.label}]; {ctx.case.dtype}, keys/values scaled to "
               f"|x| ≤ {magnitude:g} (float16's largest finite value is 65504; the float64 oracle is finite)",
               f"measured in the cache at {step.label}: {step.nonfinite}" if step.nonfinite else "",
               "likely cause: " + (
                   "the cache computes or keeps something derived from the keys/values in the 16-bit dtype that "
                   "overflows where they are large: a quantization scale or zero point, a norm or a sum of squares "
                   "(|x| > 256 squares past 65504), a range max − min — compute and keep it in float32"
                   if step.nonfinite or not math.isfinite(cmp.max_abs) else
                   "the cache loses precision on large keys/values in the 16-bit dtype: a scale or offset that rounds "
                   "them, or an accumulation in the 16-bit dtype")],
              {"max_abs": cmp.max_abs, "failed_at": step.label, "largest_kv": largest})
