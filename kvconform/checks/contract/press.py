"""The press contract of family ``contract`` (``kind="press"``): short prompts, an exact prefill, the length of the
tokens seen, held keys a subset of the prefill's (``check_press_contract``).
"""

from __future__ import annotations

from kvconform.checks import IGNORES_OPS, Param, register
from kvconform.checks._diagnosis import describe_exception
from kvconform.checks._drive import case_generator, encoder_ids_for, forward, seq_length
from kvconform.checks._measure import layer_items, read_attr, self_half
from kvconform.checks.contract.evicting import _tokens
from kvconform.oracle import compare_logits
from kvconform.subjects import PRESS


# ======================================================================================================================
# The press contract (kind "press")
# The contract of a KV *press* (``kind="press"``, ``kvconform_press = {budget}``; family ``contract``).
#
# A press compresses the prefill: it keeps a subset of the prefill's tokens exactly, at any prompt length, with no
# token bound, and never evicts while decoding. Its logits after the prefill are lossy (judged by the quality family
# against the float64 oracle, and every cache operation by self-consistency like a lossy cache); what holds exactly
# whatever it dropped is checked here, for each prompt length of ``params.prompts`` (short prompts included):
#
# * a prompt the press cannot compress is handled (kept whole or compressed) or refused with a clear error
#   (``ValueError`` / ``RuntimeError`` naming the problem), never a raw ``IndexError`` from a tensor op;
# * the prefill itself is exact: the forward that brings the tokens attends all of them (the press compresses
#   *after* it) — its logits equal the oracle's within the float tolerance;
# * ``get_seq_length()`` is the number of tokens *seen* after every forward (prefill, decode steps, a chunk), not the
#   number held: models without ``position_ids`` and ``generate`` derive the next position from it;
# * after the prefill, what each attention layer holds is a subset of the keys the prefill computed, exactly (bit for
#   bit, per row and head: a press keeps tokens, it does not quantize them — a press that also quantizes declares
#   ``kvconform_lossy``), and no more tokens than were fed.


CLEAR_WORDS = ("prompt", "short", "token", "compress", "press", "length", "at least", "too few")
RAW_ERRORS = (IndexError, KeyError, AttributeError, ZeroDivisionError)


PRESS_ONLY = "applies to press subjects only (kind='press': a cache that compresses the prefill)"
"""The skip reason of ``check_press_contract`` (``judges=(PRESS,)``) on every other kind."""


def _layer_keys(cache) -> dict:
    """``{layer index: keys [B, H, T, D]}`` of every layer of ``cache`` (its self-attention half) exposing a 4-d
    ``keys`` tensor."""
    import torch

    out = {}
    for i, layer in layer_items(self_half(cache)):
        keys = read_attr(layer, "keys")
        if isinstance(keys, torch.Tensor) and keys.dim() == 4:
            out[i] = keys
    return out


def _not_a_subset(held, fed) -> tuple | None:
    """``(batch, head, slot)`` of the first held key vector that equals no fed key vector of its row and head (bit
    for bit), or None when every held key is one of the fed ones."""

    for b in range(held.shape[0]):
        for h in range(held.shape[1]):
            same = (held[b, h][:, None, :] == fed[b, h][None, :, :]).all(-1).any(-1)  # [T_held]
            if not bool(same.all()):
                return b, h, int((~same).nonzero()[0])
    return None


@register("contract", needs=("forward",), judges=(PRESS,), unjudged=PRESS_ONLY, params={
    "prompts": Param(list, default=[1, 2, 3, 12], items=int, min=1,
                     doc="prompt lengths prefilled (short ones included)"),
    "decode": Param(int, default=3, min=1, doc="decode steps after each prefill"),
    "chunk": Param(int, default=4, min=1, doc="tokens of the chunk fed after the decode steps"),
}, ops=IGNORES_OPS)
def check_press_contract(ctx):
    """For each prompt length: the prefill is handled or refused clearly, exact, and then every forward leaves
    ``get_seq_length()`` = tokens seen and each attention layer holding an exact subset of the keys it was fed."""
    import torch

    from kvconform.reference import ReferenceCache

    params = ctx.case.params
    prompts = list(params.prompts)
    steps, chunk = params.decode, params.chunk
    gen = case_generator(ctx.case, ctx.model.name)
    enc = encoder_ids_for(ctx, gen)
    B, tol = ctx.case.batch, ctx.tolerance()
    refused, most_dropped = [], 0
    for P in prompts:
        program = [("prefill", P)] + [("decode", 1)] * steps + [("chunk", chunk)]
        ops_text = f"prefill({P}) → decode×{steps} → chunk({chunk})"
        cache, ref = ctx.new_cache(), ReferenceCache(ctx.model.config)
        seq = torch.zeros(B, 0, dtype=torch.long)
        for i, (name, n) in enumerate(program):
            label = f"prefill({P})" if name == "prefill" else f"decode {i} of {steps}" if name == "decode" \
                else f"chunk({n})"
            tokens = _tokens(ctx, gen, B, n, prompt=name == "prefill")
            start = seq.shape[1]
            try:
                logits = forward(ctx.model, cache, tokens, start, "implicit", enc, first=start == 0)
            except Exception as exc:  # noqa: BLE001 - judged: a clear refusal of a short prompt is allowed
                if name == "prefill" and not isinstance(exc, RAW_ERRORS) and \
                        any(w in str(exc).lower() for w in CLEAR_WORDS):
                    refused.append(f"{P}: {type(exc).__name__}")
                    break
                ctx.fail([f"{label} raised {describe_exception(exc)}",
                          f"ops: {ops_text}   [raised at {label}]",
                          "likely cause: " + (f"the press does not handle a {P}-token prompt: it should keep it (or "
                                              f"compress it) or refuse it with a clear error naming the prompt length"
                                              if name == "prefill" else
                                              "the press breaks the forwards after its compressed prefill")],
                         {"raised": type(exc).__name__, "failed_at": label, "prompt": P})
            forward(ctx.model, ref, tokens, start, "explicit", enc, first=start == 0)
            seq = torch.cat([seq, tokens], dim=1)
            fed = int(seq.shape[1])
            if name == "prefill":
                cmp = compare_logits(logits, ctx.oracle.logits(seq, encoder_ids=enc),
                                     ctx.oracle.uncached(seq, encoder_ids=enc), tol)
                if not cmp.passed:
                    ctx.fail([f"{label} into an empty cache: max|Δlogit| = {cmp.max_abs:.1e} against the oracle, but "
                              f"should be ≤ {cmp.tol:.1e} ({tol.describe(cmp.floor)})",
                              f"ops: {ops_text}   [failed at {label}]",
                              "likely cause: the press drops tokens inside the forward that brings them: that forward "
                              "must attend its whole chunk (update() returns every token) and compress afterwards"],
                             {"max_abs": cmp.max_abs, "tolerance": cmp.tol, "failed_at": label, "prompt": P})
            reported = seq_length(cache)
            held = {i: int(k.shape[-2]) for i, k in _layer_keys(cache).items()}
            if reported is not None and reported != fed:
                cause = (f"get_seq_length() reports the tokens held ({reported}), not the tokens seen ({fed}): the "
                         f"press dropped {fed - reported} and the next token gets position {reported} instead of "
                         f"{fed} where positions derive from the cache (no position_ids, generate's cache_position), "
                         f"and crop(-k) cuts from the wrong length — count the tokens seen in each layer and announce "
                         f"get_mask_sizes(q) = (held + q, seen − held)"
                         if reported in held.values() else
                         "get_seq_length() must count every token seen since the last reset (the next position), "
                         "whatever the press dropped")
                ctx.fail([f"get_seq_length() = {reported} after {label}, but should be {fed} (tokens seen)",
                          f"ops: {ops_text}   [failed at {label}]", f"likely cause: {cause}"],
                         {"reported": reported, "tokens_fed": fed, "failed_at": label, "prompt": P})
            # after the prefill every key was computed by the exact forward: what is held must be a subset of them
            # (later tokens' keys in deeper layers depend on the compressed history, so they differ by design)
            ref_keys = _layer_keys(ref) if name == "prefill" else {}
            for li, keys in _layer_keys(cache).items():
                fed_keys = ref_keys.get(li)
                if fed_keys is None or fed_keys.shape[:2] != keys.shape[:2]:
                    continue
                if keys.shape[-2] > fed_keys.shape[-2]:
                    ctx.fail([f"attention layer {li} holds {keys.shape[-2]} tokens per row after {label}, but only "
                              f"{fed_keys.shape[-2]} were fed", f"ops: {ops_text}   [failed at {label}]",
                              "likely cause: the press stores tokens twice (a kept copy beside the compressed one)"],
                             {"layer": li, "failed_at": label, "prompt": P})
                where = _not_a_subset(keys.to(fed_keys.dtype), fed_keys)
                if where is not None:
                    b, h, slot = where
                    ctx.fail([f"attention layer {li} holds a key (batch={b}, head={h}, slot {slot}) after {label} "
                              f"that equals none of the {fed_keys.shape[-2]} keys fed to it, but a press keeps a "
                              f"subset of the tokens exactly", f"ops: {ops_text}   [failed at {label}]",
                              "likely cause: the press changes the keys it keeps (rounds, merges or re-rotates them): "
                              "a cache that compresses what it keeps declares kvconform_lossy instead"],
                             {"layer": li, "failed_at": label, "prompt": P})
                most_dropped = max(most_dropped, fed - int(keys.shape[-2]))
            ref_keys = {}
    ctx.metrics.update(prompts=prompts, refused=refused, most_dropped=most_dropped)
