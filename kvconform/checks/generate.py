"""Family ``generate``: ``model.generate(cache=subject)`` behaves like ``generate(use_cache=False)``.

Greedy decoding must produce the same tokens, and the logits ``generate`` saw at every step must match the float64
oracle of the generated sequence within the tolerance (so a near-tie flip is told apart from a real fault).
"""

from __future__ import annotations

from kvconform import compat
from kvconform.checks import register
from kvconform.checks._engine import SubjectRaised, case_generator, describe_raise, random_tokens, token_mismatch
from kvconform.oracle import compare_logits


def _generate(ctx, cache_kwargs):
    import torch

    model, case = ctx.model, ctx.case
    gen = case_generator(case, model.name)
    prompt = random_tokens(gen, case.batch, case.encoder_len if model.is_encoder_decoder else case.prompt,
                           model.vocab_size)
    device = next(model.model.parameters()).device
    with torch.no_grad():
        out = model.model.generate(
            prompt.to(device), attention_mask=torch.ones_like(prompt).to(device),
            max_new_tokens=case.max_new_tokens, min_new_tokens=case.max_new_tokens, do_sample=False,
            return_dict_in_generate=True, output_logits=True, **cache_kwargs,
        )
    logits = torch.stack([x.detach().to("cpu", torch.float64) for x in out.logits], dim=1)  # [B, N, V]
    return prompt, out.sequences.cpu(), logits


@register("generate", needs=("generate",))
def check_generate_greedy(ctx):
    """Greedy ``generate(cache=subject)`` equals ``generate(use_cache=False)`` token for token; its step logits
    equal the oracle's."""
    model, case = ctx.model, ctx.case
    try:
        prompt, seq, logits = _generate(ctx, compat.generate_cache_kwargs(ctx.new_cache(), ctx.model.model))
    except Exception as exc:  # noqa: BLE001
        err = SubjectRaised("generate", exc)
        ctx.fail([f"generate(cache=subject) raised {describe_raise(err)}",
                  f"ops: generate(prompt {case.prompt}, max_new_tokens={case.max_new_tokens})",
                  "likely cause: the cache lacks something generate() calls (see the exception)"],
                 {"raised": type(exc).__name__})
    _, ref_seq, _ = _generate(ctx, {"use_cache": False})
    n = case.max_new_tokens
    if model.is_encoder_decoder:
        enc, dec, first = prompt, seq[:, :-1], 0
    else:
        enc, dec, first = None, seq[:, :-1], prompt.shape[1] - 1
    sl = slice(first, first + n)
    oracle = ctx.oracle.logits(dec, encoder_ids=enc)[:, sl]
    uncached = ctx.oracle.uncached(dec, encoder_ids=enc)[:, sl]
    cmp = compare_logits(logits, oracle, uncached, ctx.tolerance())
    ctx.metrics.update(max_abs=cmp.max_abs, tolerance=cmp.tol, noise_floor=cmp.floor, new_tokens=n)
    same = bool((seq == ref_seq).all()) if seq.shape == ref_seq.shape else False
    if cmp.passed and same:
        return
    lines = []
    if not cmp.passed:
        b, s = cmp.worst
        lines += [f"max|Δlogit| = {cmp.max_abs:.1e}, but should be ≤ {cmp.tol:.1e} "
                  f"({ctx.tolerance().describe(cmp.floor)})",
                  f"worst at batch={b} step={s} position={first + s}"]
    if not same:
        lines.append(token_mismatch(seq, ref_seq, "generated tokens", "generate(use_cache=False)"))
    lines.append(f"ops: generate(prompt {prompt.shape[1]}, greedy, max_new_tokens={n})")
    lines.append("likely cause: " + ("the cache corrupts what generate() feeds it between steps"
                                     if not cmp.passed else
                                     "a near-tie flipped the greedy token although the logits are within tolerance"))
    ctx.fail(lines, {"tokens_equal": same})
