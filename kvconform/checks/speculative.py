"""Family ``speculative``: transformers' own candidate generators drive the subject's rollbacks end to end.

Speculative decoding is the main real-world user of ``crop``: each step feeds the target model the current token
plus ``k`` candidate tokens in one forward (a chunk into a warm cache), keeps the longest prefix the target agrees
with, and crops the rejected rest from the cache before the next step. The crop family simulates that; this family
runs the real thing, with the subject as the target model's cache:

* ``check_speculative_greedy``, ``params.mode = "prompt_lookup"``: ``generate(prompt_lookup_num_tokens=k)``
  (candidates copied from an earlier occurrence of the last n-gram; the prompt repeats one on purpose);
  ``"assisted"``: ``generate(assistant_model=draft)`` with a tiny draft of the same vocabulary: the zoo family built
  from another seed, or the zoo's llama for a model outside the zoo (it disagrees often, so most steps roll back);
  with ``params.subject_is = "draft_cache"`` the subject is the draft's cache instead; ``"dflash"``:
  ``generate(speculation_type="dflash", assistant_model=drafter)`` (transformers >= 5.25) with a tiny seeded
  ``MuseGlimmerAssistantModel`` that drafts a block of candidates from the target's hidden states in one forward
  (``_dflash_drafter``); the generator builds the drafter's ``DFlashCache`` itself, so the subject is the target's
  cache there;
* ``check_speculative_mtp``: ``generate(use_mtp=True)`` on a model with MTP layers (the zoo's ``glm4_mtp``), the
  subject the model's cache or, for an ``MtpCache``, the MTP layers' cache.

A draft's cache cannot change the tokens (the target verifies every candidate), so where the subject is a draft's
cache the candidates themselves are judged: the target's input ids at each verification forward against the same
run with a reference draft cache.

Greedy speculative decoding must produce exactly the tokens of greedy decoding without a cache
(``generate(use_cache=False)`` at the case dtype; the float64 oracle's greedy is named when they differ). Every
``crop`` the generator makes is counted (``metrics["crops"]``), and those that remove tokens are rollbacks
(``metrics["rollbacks"]``, with ``tokens_rolled_back``, also in the item's ``Measured``): an item whose run never
rolled back measured nothing and fails as blind (``Measured.blind``), rather than passing. Batch 1: every
candidate generator runs in generate()'s ``_assisted_decoding``, which raises ``ValueError("assisted generate is
only supported for batch_size = 1")`` at batch > 1 (5.5.4 and 5.25.0; pinned by tests/semantics/test_speculative.py).
"""

from __future__ import annotations

import copy

from kvconform import compat
from kvconform.checks import EXACT, IGNORES_OPS, Param, register
from kvconform.checks._drive import SubjectRaised, case_generator, generate, random_tokens, seq_length
from kvconform.checks._diagnosis import describe_raise, token_mismatch
from kvconform.memo import MEMO
from kvconform.outcomes import CheckSkipped

TRANSFORMERS_ONLY = ("transformers' candidate generators (prompt lookup, a draft model) run inside transformers' "
                     "generate(); kvconform decodes a from-scratch model with its own greedy loop")
"""Why no check of this family applies to a model outside transformers (``register(..., transformers_only=...)``)."""

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
    tokens they removed, ``history`` the tokens each crop removed, in order (None where unknown)."""

    def __init__(self, cache):
        self.crops = self.rollbacks = self.removed = 0
        self.history: list = []
        original = cache.crop

        def crop(argument, *args, **kwargs):
            self.crops += 1
            removed = compat.tokens_removed_by_crop(argument, seq_length(cache))
            self.history.append(removed)
            if removed:
                self.rollbacks += 1
                self.removed += removed
            return original(argument, *args, **kwargs)

        cache.crop = crop


@register("speculative", cost=2.0, needs=("generate", "crop"), ops=IGNORES_OPS, judges=(EXACT,),
          transformers_only=TRANSFORMERS_ONLY,
          unjudged="{subject} is not exact: speculative decoding's tokens are compared with the exact model's greedy "
                   "tokens, which a lossy or evicting cache need not reproduce",
          params={"mode": Param(str, required=True, choices=("prompt_lookup", "assisted", "dflash"),
                                doc="which candidate generator: prompt lookup, a draft model, or a DFlash drafter "
                                    "(block diffusion from the target's hidden states, transformers >= 5.25)"),
                  "candidates": Param(int, default=3, min=1, max=16,
                                      doc="prompt_lookup_num_tokens (prompt lookup) / num_assistant_tokens"),
                  "subject_is": Param(str, default="target_cache", choices=("target_cache", "draft_cache"),
                                      doc="whose cache the subject is: the target model's, or (mode assisted) the "
                                          "draft model's")})
def check_speculative_greedy(ctx):
    """Greedy ``generate`` with transformers' candidate generator (prompt lookup or a draft model) and the subject
    as the target's cache gives the tokens of ``generate(use_cache=False)``, and the run rolled the cache back at
    least once. With ``subject_is = "draft_cache"`` the subject is the draft model's cache instead
    (``_check_draft_cache``)."""
    case = ctx.case
    if case.params.subject_is == "draft_cache":
        return _check_draft_cache(ctx)
    mode, k = case.params.mode, case.params.candidates
    prompt = _prompt(ctx)
    if mode == "prompt_lookup":
        extra: dict = {"prompt_lookup_num_tokens": k}
    elif mode == "dflash":
        extra = {"assistant_model": _dflash_drafter(ctx, k), "speculation_type": "dflash"}
    else:
        extra = {"assistant_model": _draft(ctx), "num_assistant_tokens": k,
                 "num_assistant_tokens_schedule": "constant"}
    cache = ctx.new_cache()
    if getattr(cache, "is_croppable", True) is False:  # transformers' generators refuse it up front, as they must
        raise CheckSkipped(f"{ctx.subject.name} reports is_croppable = False on {ctx.model.name} (a cache that cannot "
                           f"roll back, e.g. static sliding-window layers): transformers refuses speculative "
                           f"decoding with it (ValueError), so there is no rollback to judge")
    counter = CropCounter(cache)
    ops = (f"generate(prompt {prompt.shape[1]}, greedy, max_new_tokens={case.max_new_tokens}, "
           + {"prompt_lookup": f"prompt_lookup_num_tokens={k})",
              "dflash": f"speculation_type='dflash', assistant_model=DFlash drafter, block_size={k})"}.get(
               mode, f"assistant_model=draft, {k} candidates a step)"))
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
    _judge(ctx, seq, prompt, counter, ops, mode)


def _dflash_drafter(ctx, block_size: int):
    """The DFlash drafter of the item (``DFlashTokenCandidateGenerator``'s assistant): transformers'
    ``MuseGlimmerAssistantModel`` with one layer, the target's hidden size and head layout, reading the target's
    hidden states after its first and last layers (``target_layer_ids``), drafting ``block_size`` tokens (the first
    the target's last token, so ``block_size - 1`` candidates) a step, weights from seed ``DRAFT_SEED``; built once per
    process, model and dtype. It has no LM head of its own: the generator reads its candidates through the target's
    output embeddings, so any vocabulary works.

    Raises:
        CheckSkipped: the installed transformers has no DFlash drafter (before 5.25), or the target is not a
            decoder whose layers and head sizes the drafter can take.
    """
    import torch

    try:
        from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
    except ImportError:
        raise CheckSkipped("the installed transformers has no DFlash drafter (MuseGlimmerAssistantModel and "
                           "speculation_type='dflash' came in 5.25)") from None
    target = ctx.model.model
    tc = target.config.get_text_config(decoder=True)
    dtype, device = next(target.parameters()).dtype, next(target.parameters()).device
    heads = int(getattr(tc, "num_attention_heads", 0) or 0)
    layers = int(getattr(tc, "num_hidden_layers", 0) or 0)
    if not heads or not layers or target.get_output_embeddings() is None:
        raise CheckSkipped(f"{ctx.model.name} has no attention heads, layers or output embeddings a DFlash drafter "
                           f"can read")
    key = ("dflash", ctx.model.name, str(dtype), block_size)
    if key not in _DRAFTS:
        head_dim = int(getattr(tc, "head_dim", 0) or tc.hidden_size // heads)
        config = MuseGlimmerAssistantConfig(
            hidden_size=tc.hidden_size, intermediate_size=2 * tc.hidden_size, num_hidden_layers=1,
            num_attention_heads=heads, num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=head_dim, target_layer_ids=sorted({0, layers - 1}), block_size=block_size,
            mask_token_id=int(ctx.model.vocab_size) - 1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            sliding_window=4096)
        torch.manual_seed(DRAFT_SEED)
        _DRAFTS[key] = MuseGlimmerAssistantModel(config).to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]  # transformers types .to() through a wrapper
    return _DRAFTS[key]


def _check_draft_cache(ctx):
    """The subject as the draft model's cache in ``generate(assistant_model=draft)`` (the target's cache a
    ``DynamicCache``). The target verifies every candidate, so the tokens cannot show a wrong draft cache: the
    drafts themselves are judged — the target's input ids at each verification forward (the last token and the
    draft's candidates) must be those of the same run with kvconform's ``ReferenceCache`` as the draft's cache —, and
    the tokens against ``generate(use_cache=False)`` as in the target role. The draft's cache is handed to the
    draft's own ``generate`` (transformers threads it through the assistant's kwargs, starting from none: kvconform's
    draft model is given it on its first call); the draft's crops are counted."""
    from kvconform.reference import ReferenceCache

    case = ctx.case
    if case.params.mode == "prompt_lookup":
        raise CheckSkipped("prompt lookup has no draft model, so there is no draft's cache to judge")
    if case.params.mode == "dflash":
        raise CheckSkipped("transformers' DFlash generator builds its drafter's DFlashCache itself and takes none "
                           "(5.25), so the subject cannot be handed to it as the drafter's cache")
    if ctx.model.name not in _zoo_names():
        raise CheckSkipped(f"the draft of {ctx.model.name} is the zoo's llama, whose cache the subject would be "
                           f"built for a model it was not built for; the draft-cache role runs on zoo models")
    cache = ctx.new_cache()  # the draft is the same zoo family: the same config shapes
    if getattr(cache, "is_croppable", True) is False:
        raise CheckSkipped(f"{ctx.subject.name} reports is_croppable = False on {ctx.model.name}: assisted "
                           f"decoding crops the draft's cache after every step, which it cannot")
    counter = CropCounter(cache)
    prompt = _prompt(ctx)
    k = case.params.candidates
    ops = (f"generate(prompt {prompt.shape[1]}, greedy, max_new_tokens={case.max_new_tokens}, assistant_model=draft, "
           f"{k} candidates a step), the subject as the draft's cache")
    try:
        seq, fed = _run_assisted(ctx, prompt, k, cache)
    except Exception as exc:  # noqa: BLE001 - the subject's failure, named with the op that raised
        err = SubjectRaised("generate", exc)
        ctx.fail([f"assisted generate with the subject as the draft's cache raised {describe_raise(err)}",
                  f"ops: {ops}", f"likely cause: the draft's crop() after {counter.crops} crop(s) left the cache in a "
                                 f"state the draft's next step cannot use" if counter.rollbacks else
                  "likely cause: the cache lacks something the draft's generate calls (see the exception)"],
                 {"raised": type(exc).__name__, "crops": counter.crops, "rollbacks": counter.rollbacks})
    _, expected = _run_assisted(ctx, prompt, k, ReferenceCache(config=ctx.model.model.config))
    ctx.measured.record(rollbacks=counter.rollbacks, tokens_rolled_back=counter.removed)
    ctx.metrics.update(role="draft_cache", draft_steps=len(fed))
    if fed != expected:
        step = next(i for i, (a, b) in enumerate(zip(fed + [None] * len(expected), expected + [None] * len(fed)))
                    if a != b)
        ctx.fail([f"the draft proposed other tokens with the subject as its cache than with kvconform's "
                  f"ReferenceCache: at verification step {step} the target was fed "
                  f"{fed[step] if step < len(fed) else 'nothing'} (last token + candidates), with the reference "
                  f"{expected[step] if step < len(expected) else 'nothing'}",
                  f"ops: {ops}; {counter.rollbacks} rollback(s) of the subject",
                  "likely cause: the draft's crop() after a step whose candidates the target rejected keeps a "
                  "rejected candidate or drops an accepted token"],
                 {"crops": counter.crops, "rollbacks": counter.rollbacks})
    _judge(ctx, seq, prompt, counter, ops, "assisted")


def _zoo_names():
    from kvconform import zoo

    return zoo.ALL_NAMES


def _fed_recorder(model, fed: list):
    """A forward pre-hook on ``model`` appending row 0 of each forward's input ids to ``fed`` (observes, changes
    nothing); returns its handle."""

    def record(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            fed.append(ids[0].tolist())

    return model.register_forward_pre_hook(record, with_kwargs=True)


def _run_assisted(ctx, prompt, k, draft_cache):
    """``generate(assistant_model=draft)`` of the item's prompt with a ``DynamicCache`` as the target's cache and
    ``draft_cache`` as the draft's (handed to the draft's ``generate`` on its first call, when transformers passes it
    none). Returns the sequences and the target's input ids at each verification forward after the prefill."""
    from transformers import DynamicCache

    draft = _draft(ctx)
    key = compat.cache_kwarg(draft)
    original = draft.generate

    def generate_with_cache(*args, **kwargs):
        if kwargs.get(key) is None:
            kwargs[key] = draft_cache
            # what generate does to an assistant's cache it builds itself (5.25: only to those), so that a sliding
            # layer keeps the past it must restore on crop
            if hasattr(draft_cache, "activate_past_recording"):
                draft_cache.activate_past_recording(recurrent_states_to_keep=k)
            config = kwargs.get("generation_config")
            if config is not None and getattr(config, "cache_implementation", None) is not None:
                # transformers 5.5: the assistant's first call asks generate() to build its cache
                # (cache_implementation "dynamic_full", which refuses a cache passed beside it); the subject stands in
                # for that cache, so this call alone gets a copy of the config without it
                config = copy.copy(config)
                config.cache_implementation = None
                kwargs["generation_config"] = config
        return original(*args, **kwargs)

    fed: list = []
    draft.generate = generate_with_cache  # this instance only, kvconform's own draft model
    # the draft drafts all k candidates: by default it stops at a candidate it is less than 0.4 sure of, which a
    # tiny random draft always is after its first, and one candidate a step leaves nothing to roll back in its cache
    threshold = getattr(draft.generation_config, "assistant_confidence_threshold", None)
    draft.generation_config.assistant_confidence_threshold = 0.0
    hook = _fed_recorder(ctx.model.model, fed)
    try:
        seq, _, _ = generate(ctx.model, prompt, ctx.case.max_new_tokens,
                             compat.generate_cache_kwargs(DynamicCache(config=ctx.model.model.config),
                                                          ctx.model.model),
                             assistant_model=draft, num_assistant_tokens=k,
                             num_assistant_tokens_schedule="constant")
    finally:
        hook.remove()
        del draft.generate
        draft.generation_config.assistant_confidence_threshold = threshold
    return seq, fed[1:]


def _judge(ctx, seq, prompt, counter, ops, mode):
    """Compare ``seq`` with ``generate(use_cache=False)`` (naming the float64 oracle's greedy on a mismatch) and
    record the rollbacks ``counter`` counted (``ctx.measured``: 0 rollbacks is a blind item, ``Measured.blind``)."""
    case = ctx.case
    ref, _, _ = generate(ctx.model, prompt, case.max_new_tokens, {"use_cache": False})
    same = tuple(seq.shape) == tuple(ref.shape) and bool((seq == ref).all())
    ctx.measured.record(rollbacks=counter.rollbacks, tokens_rolled_back=counter.removed)
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


# ---------------------------------------------------------------------------------------------------- MTP
_MTP_FOLDERS: dict = MEMO.table("speculative.mtp_folders")


def mtp_layers(config) -> int:
    """``num_mtp_layers`` of ``config``'s text config (0 where it has none): the model's multi-token-prediction
    layers, which ``generate(use_mtp=True)`` drafts with."""
    return int(getattr(config.get_text_config(decoder=True), "num_mtp_layers", 0) or 0)


def _mtp_folder(zm) -> str:
    """A folder holding ``zm``'s weights and seeded MTP layers (the parameters of ``MtpModel(model, n)`` drawn from
    seed ``DRAFT_SEED``: normal with the config's ``initializer_range``, norms 1, vectors 0)
    under the checkpoint names ``MtpModel.from_pretrained`` reads — ``model.layers.{N + k}.…`` for MTP layer ``k``
    of a model of ``N`` layers, the decoder block's weights without the ``mtp_block.`` level (glm4_moe /
    deepseek_v3 style) —, written once per process, model and dtype (a temporary folder, removed at exit).

    Raises:
        Exception: whatever saving the model or building its MTP layers raises."""
    import re
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    model = zm.model
    key = (zm.name, str(next(model.parameters()).dtype))
    if key not in _MTP_FOLDERS:
        folder = tempfile.TemporaryDirectory(prefix="kvconform-mtp-")
        n_layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(DRAFT_SEED)
            mtp = MtpModel(model, mtp_layers(model.config))  # for its parameter names and shapes
        weights = {}
        std = float(getattr(model.config, "initializer_range", 0.02))
        generator = torch.Generator().manual_seed(DRAFT_SEED)
        for name, tensor in mtp.state_dict().items():
            found = re.match(r"layers\.(\d+)\.(?:mtp_block\.)?(.*)", name)
            if not found:  # the embedding and head are the model's own (tied), not in the MTP checkpoint
                continue
            # every weight drawn here: MtpModel's own init leaves a MoE block's expert tensors uninitialised
            # (torch.empty: NaN drafts on glm4_moe, 5.25); norms at 1, vectors (biases) at 0
            if name.endswith("norm.weight"):
                value = torch.ones(tensor.shape)
            elif tensor.dim() >= 2:
                value = torch.randn(tensor.shape, generator=generator) * std
            else:
                value = torch.zeros(tensor.shape)
            weights[f"model.layers.{n_layers + int(found.group(1))}.{found.group(2)}"] = \
                value.to(next(model.parameters()).dtype).contiguous()
        model.save_pretrained(folder.name)
        path = f"{folder.name}/model.safetensors"
        save_file({**load_file(path), **weights}, path, metadata={"format": "pt"})
        _MTP_FOLDERS[key] = folder
    return _MTP_FOLDERS[key].name


class _MtpSetup:
    """While entered: ``zm``'s model reads its MTP layers from ``_mtp_folder`` (its ``config.name_or_path``, a
    ``torch.dtype`` in ``config.dtype`` as ``from_pretrained`` leaves it, and the checkpoint names of its MTP layers
    in ``_keys_to_ignore_on_load_unexpected``, whose layer numbers a full-size checkpoint has), and with
    ``mtp_cache`` given, transformers' ``MTPCandidateGenerator`` drafts with that cache instead of a new
    ``MtpCache`` (it looks the class up in ``transformers.cache_utils`` when it starts). Everything is restored on
    exit."""

    def __init__(self, zm, mtp_cache=None):
        self.zm, self.mtp_cache = zm, mtp_cache

    def __enter__(self):
        from transformers import cache_utils

        model = self.zm.model
        config = model.config
        n_layers = int(config.get_text_config(decoder=True).num_hidden_layers)
        self.saved = (config.name_or_path, getattr(config, "dtype", None), model.__dict__.get(
            "_keys_to_ignore_on_load_unexpected"), cache_utils.MtpCache)
        config.name_or_path = _mtp_folder(self.zm)
        config.dtype = next(model.parameters()).dtype
        model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n_layers + k}\..*"
                                                    for k in range(mtp_layers(config))]
        if self.mtp_cache is not None:
            setattr(cache_utils, "MtpCache", lambda *args, **kwargs: self.mtp_cache)  # noqa: B010 - a class slot
        return self

    def __exit__(self, *exc):
        from transformers import cache_utils

        model = self.zm.model
        model.config.name_or_path, model.config.dtype, ignore, mtp_class = self.saved
        setattr(cache_utils, "MtpCache", mtp_class)  # noqa: B010 - a class slot
        if ignore is None:
            model.__dict__.pop("_keys_to_ignore_on_load_unexpected", None)
        else:
            model._keys_to_ignore_on_load_unexpected = ignore
        return False


@register("speculative", cost=2.0, needs=("crop",), ops=IGNORES_OPS, judges=(EXACT,),
          transformers_only=TRANSFORMERS_ONLY,
          unjudged="{subject} is not exact: speculative decoding's tokens are compared with the exact model's greedy "
                   "tokens, which a lossy or evicting cache need not reproduce")
def check_speculative_mtp(ctx):
    """Greedy ``generate(use_mtp=True)`` on a model with MTP layers (``MTPCandidateGenerator``: the model's own
    MTP layers draft ``num_mtp_layers`` tokens a step) gives the tokens of ``generate(use_cache=False)``, and the
    subject's cache was rolled back at least once. The subject plays the cache it is: an ``MtpCache`` (or subclass)
    is the MTP layers' cache — rolled back by ``crop(-num_mtp_layers)`` when a step accepts no candidate, its query
    offsets shifted by ``layer_idx + 1`` —, with a ``DynamicCache`` for the model; any other subject is the model's
    own cache, with transformers' ``MtpCache`` for the MTP layers.

    Skips: transformers without ``MtpCache``; a model without MTP layers; a subject that is the model's cache
    without the ``generate`` capability."""
    from transformers import cache_utils

    case = ctx.case
    if not hasattr(cache_utils, "MtpCache"):
        raise CheckSkipped(f"transformers {compat.transformers_version()} has no MtpCache (generate(use_mtp=True) "
                           f"and MTPCandidateGenerator came with 5.25)")
    n_mtp = mtp_layers(ctx.model.config)
    if n_mtp < 1:
        raise CheckSkipped(f"{ctx.model.name} has no MTP layers (num_mtp_layers is not set): generate(use_mtp=True) "
                           f"does not apply")
    cache = ctx.new_cache()
    drafts = isinstance(cache, cache_utils.MtpCache)
    if not drafts and "generate" not in ctx.subject.capabilities:
        raise CheckSkipped(f"{ctx.subject.name} does not declare generate, which the MTP path runs with it as "
                           f"the model's cache")
    if getattr(cache, "is_croppable", True) is False:
        raise CheckSkipped(f"{ctx.subject.name} reports is_croppable = False on {ctx.model.name}: transformers "
                           f"refuses speculative decoding with it (ValueError), so there is no rollback to judge")
    counter = CropCounter(cache)
    prompt = _prompt(ctx)
    role = "the MTP layers' cache (the model's: DynamicCache)" if drafts else "the model's cache"
    ops = (f"generate(prompt {prompt.shape[1]}, greedy, max_new_tokens={case.max_new_tokens}, use_mtp=True: "
           f"{n_mtp} MTP layers draft {n_mtp} tokens a step), the subject as {role}")
    try:
        seq, fed = _run_mtp(ctx, prompt, cache if drafts else None, None if drafts else cache)
    except Exception as exc:  # noqa: BLE001 - the subject's failure, named with the op that raised
        err = SubjectRaised("generate", exc)
        ctx.fail([f"MTP generate with the subject as {role} raised {describe_raise(err)}", f"ops: {ops}",
                  f"likely cause: a crop() after {counter.crops} crop(s) ({counter.rollbacks} rollback(s)) "
                  f"left the cache in a state the next forward cannot use"
                  if counter.rollbacks else "likely cause: the cache lacks something the MTP path calls (see the "
                                            "exception)"],
                 {"raised": type(exc).__name__, "crops": counter.crops, "rollbacks": counter.rollbacks})
    ctx.metrics.update(role="mtp_cache" if drafts else "target_cache")
    ctx.measured.record(rollbacks=counter.rollbacks, tokens_rolled_back=counter.removed)
    if drafts:  # the drafts never change the tokens (the model verifies them): judge the drafts themselves
        _, expected = _run_mtp(ctx, prompt, ReferenceMtpCache(config=ctx.model.model.config.get_mtp_config()), None)
        ctx.metrics.update(draft_steps=len(fed))
        if fed != expected:
            step = next(i for i, (a, b) in enumerate(zip(fed + [None] * len(expected),
                                                         expected + [None] * len(fed))) if a != b)
            ctx.fail([f"the MTP layers drafted other tokens with the subject as their cache than with kvconform's "
                      f"reference MtpCache: at verification step {step} the model was fed "
                      f"{fed[step] if step < len(fed) else 'nothing'} (last token + candidates), with the reference "
                      f"{expected[step] if step < len(expected) else 'nothing'}",
                      f"ops: {ops}; {counter.rollbacks} rollback(s) of the subject",
                      "likely cause: the MTP cache's query offset / mask sizes (shifted by layer_idx + 1) or its "
                      "crop(-num_mtp_layers) after a step that accepted no candidate"],
                     {"crops": counter.crops, "rollbacks": counter.rollbacks})
    _judge(ctx, seq, prompt, counter, ops, "mtp")


def _run_mtp(ctx, prompt, mtp_cache, target):
    """``generate(use_mtp=True)`` of the item's prompt with ``mtp_cache`` as the MTP layers' cache (None:
    transformers' own ``MtpCache``) and ``target`` as the model's (None: a ``DynamicCache``). Returns the sequences
    and the model's input ids at each verification forward after the prefill (the last accepted token and the MTP
    layers' candidates), observed by a forward pre-hook on the model."""
    from transformers import DynamicCache

    target = target if target is not None else DynamicCache(config=ctx.model.model.config)
    fed: list = []
    hook = _fed_recorder(ctx.model.model, fed)
    try:
        with _MtpSetup(ctx.model, mtp_cache):
            seq, _, _ = generate(ctx.model, prompt, ctx.case.max_new_tokens,
                                 compat.generate_cache_kwargs(target, ctx.model.model), use_mtp=True)
    finally:
        hook.remove()
    return seq, fed[1:]  # after the prefill: each verification forward, the last token and the MTP candidates


def _reference_mtp_cache():
    """``ReferenceMtpCache``: kvconform's ``ReferenceCache`` with ``MtpCache``'s shift (query offset and mask offset
    of MTP layer ``k`` advanced by ``k + 1``): the reference the MTP layers' drafts are judged against when the
    subject is their cache."""
    from kvconform.reference import ReferenceCache

    class ReferenceMtpCache(ReferenceCache):
        def get_query_offset(self, layer_idx: int = 0):
            return super().get_query_offset(layer_idx) + layer_idx + 1

        def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
            kv_length, kv_offset = super().get_mask_sizes(query_length, layer_idx)
            return kv_length, kv_offset + layer_idx + 1

    return ReferenceMtpCache


def ReferenceMtpCache(config):  # noqa: N802 - a cache class's name, built on demand (transformers imported late)
    """A fresh ``ReferenceMtpCache`` for ``config`` (``_reference_mtp_cache``)."""
    return _reference_mtp_cache()(config=config)
