"""Family ``speculative``: transformers' own candidate generators drive the subject's rollbacks end to end.

Speculative decoding is the main real-world user of ``crop``: each step feeds the target model the current token
plus ``k`` candidate tokens in one forward (a chunk into a warm cache), keeps the longest prefix the target agrees
with, and crops the rejected rest from the cache before the next step. The crop family simulates that; this family
runs the real thing, with the subject as the target model's cache:

* ``check_speculative_greedy``, ``params.mode = "prompt_lookup"``: ``generate(prompt_lookup_num_tokens=k)``
  (candidates copied from an earlier occurrence of the last n-gram; the prompt repeats one on purpose);
  ``"assisted"``: ``generate(assistant_model=draft)`` with a tiny draft of the same vocabulary: the zoo family built
  from another seed, or the zoo's llama for a model outside the zoo (it disagrees often, so most steps roll back).

Greedy speculative decoding must produce exactly the tokens of greedy decoding without a cache
(``generate(use_cache=False)`` at the case dtype; the float64 oracle's greedy is named when they differ). Every
``crop`` the generator makes is counted (``metrics["crops"]``), and those that remove tokens are rollbacks
(``metrics["rollbacks"]``, with ``tokens_rolled_back``): an item whose run never rolled back measured nothing and
fails saying so, rather than passing. Batch 1: transformers' candidate generators decode one row.
"""

from __future__ import annotations

from kvconform import compat
from kvconform.checks import EXACT, IGNORES_OPS, Param, register
from kvconform.checks._drive import SubjectRaised, case_generator, generate, random_tokens, seq_length
from kvconform.checks._diagnosis import describe_raise, token_mismatch
from kvconform.memo import MEMO
from kvconform.outcomes import CheckSkipped

_DRAFTS: dict = MEMO.table("speculative.drafts")
DRAFT_SEED = 1
"""The seed of the draft model's weights (the target's is 0): the same family and vocabulary, other weights."""


def _draft(ctx):
    """The draft model of the item, built once per process and dtype (seed ``DRAFT_SEED``): the zoo family of the
    same name from another seed, or for a model outside the zoo (a checkpoint, an architecture) the zoo's tiny llama
    with the target's vocabulary — transformers' assisted decoding needs only the same token ids."""
    import torch

    from kvconform import zoo

    target = ctx.model.model
    dtype, device = next(target.parameters()).dtype, next(target.parameters()).device
    vocab = int(target.config.get_text_config(decoder=True).vocab_size)
    own = ctx.model.name in zoo.ALL_NAMES
    key = (ctx.model.name if own else f"llama/{vocab}", str(dtype))
    if key not in _DRAFTS:
        if own:
            _DRAFTS[key] = zoo.build_zoo_model(ctx.model.name, dtype=dtype, device=str(device), seed=DRAFT_SEED).model
        else:
            from transformers import AutoModelForCausalLM

            config = zoo.zoo_config("llama")
            config.vocab_size = vocab
            torch.manual_seed(DRAFT_SEED)
            _DRAFTS[key] = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
    return _DRAFTS[key]


def _prompt(ctx):
    """``[1, case.prompt]`` int64: a seeded n-gram of 6 tokens repeated, cut to the prompt length, so that prompt
    lookup finds its last n-gram earlier and proposes the continuation."""
    import torch

    base = random_tokens(case_generator(ctx.case, ctx.model.name), 1, 6, ctx.model.vocab_size)
    reps = -(-ctx.case.prompt // 6)
    return torch.cat([base] * reps, dim=1)[:, :ctx.case.prompt]


class CropCounter:
    """Counts the ``crop`` calls a generator makes on ``cache`` (patched on this instance only, which kvconform
    built for the item): ``crops`` all of them, ``rollbacks`` those that removed tokens under the installed
    version's contract (``compat.tokens_removed_by_crop``: ``crop(0)`` removes none from 5.14), ``removed`` the
    tokens they removed."""

    def __init__(self, cache):
        self.crops = self.rollbacks = self.removed = 0
        original = cache.crop

        def crop(argument, *args, **kwargs):
            self.crops += 1
            removed = compat.tokens_removed_by_crop(argument, seq_length(cache))
            if removed:
                self.rollbacks += 1
                self.removed += removed
            return original(argument, *args, **kwargs)

        cache.crop = crop


@register("speculative", cost=2.0, needs=("generate", "crop"), ops=IGNORES_OPS, judges=(EXACT,),
          unjudged="{subject} is not exact: speculative decoding's tokens are compared with the exact model's greedy "
                   "tokens, which a lossy or evicting cache need not reproduce",
          params={"mode": Param(str, required=True, choices=("prompt_lookup", "assisted"),
                                doc="which candidate generator: prompt lookup, or a draft model"),
                  "candidates": Param(int, default=3, min=1, max=16,
                                      doc="prompt_lookup_num_tokens (prompt lookup) / num_assistant_tokens")})
def check_speculative_greedy(ctx):
    """Greedy ``generate`` with transformers' candidate generator (prompt lookup or a draft model) and the subject
    as the target's cache gives the tokens of ``generate(use_cache=False)``, and the run rolled the cache back at
    least once."""
    case = ctx.case
    mode, k = case.params.mode, case.params.candidates
    prompt = _prompt(ctx)
    extra = ({"prompt_lookup_num_tokens": k} if mode == "prompt_lookup"
             else {"assistant_model": _draft(ctx), "num_assistant_tokens": k,
                   "num_assistant_tokens_schedule": "constant"})
    cache = ctx.new_cache()
    if getattr(cache, "is_croppable", True) is False:  # transformers' generators refuse it up front, as they must
        raise CheckSkipped(f"{ctx.subject.name} reports is_croppable = False on {ctx.model.name} (a cache that cannot "
                           f"roll back, e.g. static sliding-window layers): transformers refuses speculative "
                           f"decoding with it (ValueError), so there is no rollback to judge")
    counter = CropCounter(cache)
    ops = (f"generate(prompt {prompt.shape[1]}, greedy, max_new_tokens={case.max_new_tokens}, "
           + (f"prompt_lookup_num_tokens={k})" if mode == "prompt_lookup" else f"assistant_model=draft, {k} "
              f"candidates a step)"))
    try:
        seq, _, _ = generate(ctx.model, prompt, case.max_new_tokens,
                             compat.generate_cache_kwargs(cache, ctx.model.model), **extra)
    except Exception as exc:  # noqa: BLE001 - the subject's failure, named with the op that raised
        err = SubjectRaised("generate", exc)
        ctx.fail([f"speculative generate(cache=subject) raised {describe_raise(err)}", f"ops: {ops}",
                  f"likely cause: a crop() after {counter.crops} crop(s) ({counter.rollbacks} rollback(s)) "
                  f"left the cache in a state the next verification forward cannot use"
                  if counter.rollbacks else "likely cause: the cache lacks something speculative decoding calls "
                                            "(see the exception)"],
                 {"raised": type(exc).__name__, "crops": counter.crops, "rollbacks": counter.rollbacks})
    ref, _, _ = generate(ctx.model, prompt, case.max_new_tokens, {"use_cache": False})
    same = tuple(seq.shape) == tuple(ref.shape) and bool((seq == ref).all())
    ctx.metrics.update(tokens_equal=same, crops=counter.crops, rollbacks=counter.rollbacks,
                       tokens_rolled_back=counter.removed, new_tokens=case.max_new_tokens, mode=mode)
    if not same:
        oracle, _, _ = generate(ctx.model.oracle_model(), prompt, case.max_new_tokens, {"use_cache": False})
        agrees = tuple(oracle.shape) == tuple(ref.shape) and bool((oracle == ref).all())
        ctx.fail([token_mismatch(seq, ref, "tokens of speculative decoding", "generate(use_cache=False)"),
                  f"ops: {ops}; {counter.rollbacks} rollback(s) of {counter.removed} token(s) in {counter.crops} "
                  f"crop(s)",
                  "oracle: the float64 model's greedy tokens " + ("are the uncached ones" if agrees else
                                                                  "differ from the uncached ones too (a near-tie)"),
                  "likely cause: " + ("crop() after a verification chunk keeps a rejected candidate or drops an "
                                      "accepted token" if counter.rollbacks else
                                      "the cache corrupts what the candidate generator feeds it")])
    if counter.rollbacks == 0:
        ctx.fail([f"speculative decoding never rolled the cache back ({counter.crops} crop(s), none removing a "
                  f"token): the item measured nothing about rollbacks", f"ops: {ops}",
                  "likely cause: every candidate was accepted (a draft that agrees with the target) or the "
                  "generator never called crop(); the case needs a prompt or draft that is rejected"],
                 {"blind": "no rollback"})
