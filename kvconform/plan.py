"""The plan of a run: which items exist and which are skipped (``in_scope``, ``skip_reason``), what an item is
(``PlanItem``), and what collection knows of a model without building it (``ModelInfo``, ``model_info``).

The session (``kvconform.session``) builds the plan from these; nothing here builds a model or runs a cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvconform import zoo
from kvconform.memo import MEMO
from kvconform.ops import tokens_held
from kvconform.outcomes import UsageError
from kvconform.sources import ModelInfo, source_of  # noqa: F401 - ModelInfo re-exported (it lives with the sources)

if TYPE_CHECKING:  # PlanItem's field types, without importing the checks or torch at run time
    from kvconform.cases import Case
    from kvconform.checks import CheckInfo
    from kvconform.subjects import CacheSpec


def spec_problem(spec: str, trust_remote_code: bool = False) -> str | None:
    """Why ``--kvconform-model spec`` cannot be used, from the file system alone (no torch or transformers import,
    so that a mistyped spec is a usage error at once), or None. The whole message, naming the spec and the fix: a
    bare zoo name that is also a folder here, a folder that is not a checkpoint (no config.json, no weights), a bare
    word that is neither, a folder that ships its own code without ``trust_remote_code``. What needs its config
    (the kind of model) is checked by ``model_info``. The spec's source says it (``ModelSource.problem``)."""
    return source_of(spec).problem(trust_remote_code)


def model_info(spec: str, zoo_only: bool = False, trust_remote_code: bool = False,
               read_forward: bool = True) -> ModelInfo:
    """Inspect a zoo name or checkpoint folder (config only).

    Raises:
        UsageError: neither a zoo name nor a folder with a config.json (names the spec and what is allowed); a
            folder that ships its own code without ``trust_remote_code`` (names the flag and the code files).
    ``zoo_only``: ``spec`` is a zoo name, whatever folders the working directory holds (internal look-ups).
    ``trust_remote_code``: the user's consent to run a repository's own code (``--kvconform-trust-remote-code``).
    ``read_forward``: import the model class to read whether its forward takes ``position_ids`` (collection's skip
    reasons need it). Without it ``accepts_position_ids`` is True, as for an unknown architecture: for callers that
    only need the features or the scope of items (``zoo_features``, the known-fault universe), which would otherwise
    import the modeling code of every zoo family in every run.
    """
    from kvconform import remote
    from kvconform.architectures import auto_model_class

    problem = None if zoo_only else spec_problem(spec, trust_remote_code)
    if problem:
        raise UsageError(problem)
    known = None if zoo_only else source_of(spec).info()  # a model adapter: its own declarations, no config
    if known is not None:
        return known
    path = None if zoo_only else source_of(spec).folder()  # a checkpoint folder: its config.json
    if path is None:
        config, name = zoo.zoo_config(spec), spec
    else:
        remote_code = bool(remote.code_files(path))
        try:
            config = zoo.checkpoint_config(path, remote_code)
        except Exception as exc:  # noqa: BLE001
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UsageError(f"--kvconform-model {spec!r}: cannot read its config.json: {first}") from None
        name = zoo.checkpoint_name(path)
    # a vision-language checkpoint: its image-text-to-text class (zoo.load_checkpoint builds it with images)
    auto = auto_model_class(config, prefer_vision=path is not None)
    remote_code = path is not None and remote_code
    if remote_code and auto.__name__ not in (getattr(config, "auto_map", None) or {}) and \
            type(config) not in auto._model_mapping:
        raise UsageError(f"--kvconform-model {spec!r}: its config.json auto_map names no {auto.__name__} class, "
                         f"so it has no language-model class to check")
    if path is not None and not remote_code and type(config) not in auto._model_mapping:
        raise UsageError(
            f"--kvconform-model {spec!r}: a {config.model_type!r} checkpoint has no "
            f"{'sequence-to-sequence' if config.is_encoder_decoder else 'causal'} language-model class in transformers "
            f"({auto.__name__}{'' if config.is_encoder_decoder else ' and AutoModelForImageTextToText'} do"
            f"{'es' if config.is_encoder_decoder else ''} not map {type(config).__name__}); kvconform checks the KV "
            f"cache of autoregressive decoding, so it needs a decoder-only or encoder-decoder language model")
    accepts = True  # not read, or an unknown architecture: decided at run time
    if read_forward:
        try:
            cls = auto._model_mapping[type(config)]
            import inspect

            accepts = "position_ids" in inspect.signature(cls.forward).parameters
        except Exception:  # noqa: BLE001 - unknown architecture
            pass
    types, _ = zoo._layer_types(config)
    return ModelInfo(name, spec, types, bool(config.is_encoder_decoder), accepts, bool(remote_code))


SKIPPED_COST = 0.02
"""Estimated cost of a skipped item, relative to a logits item (``PlanItem.cost``)."""


@dataclass(frozen=True)
class PlanItem:
    """One item: subject × model × check × case, with the reason it is skipped or expected to fail."""

    subject: CacheSpec
    model: ModelInfo
    check: CheckInfo
    case: Case
    skip: str | None = None
    xfail: str | None = None

    @property
    def id(self) -> str:
        return f"{self.subject.name}-{self.model.name}-{self.check.name.removeprefix('check_')}-{self.case.id}"

    @property
    def cost(self) -> float:
        """Estimated cost of running the item, relative to a logits item: what its check declares
        (``register(..., cost=...)``), ``SKIPPED_COST`` when it is skipped. Cuts ``--kvconform-shard`` jobs
        (``merge.item_cost``) and orders the workers' scheduling (``workers.model_scheduling``)."""
        return SKIPPED_COST if self.skip else self.check.cost

    def marks(self, pytest):
        marks = [pytest.mark.kvconform, getattr(pytest.mark, f"kvconform_{self.check.family}")]
        if self.skip:
            marks.append(pytest.mark.skip(reason=self.skip))
        elif self.xfail:
            marks.append(pytest.mark.xfail(reason=self.xfail, strict=False, raises=AssertionError))
        return marks

    def describe(self) -> dict:
        return {"subject": self.subject.name, "model": self.model.name, "check": self.check.name,
                "family": self.check.family, "case": self.case.id}

    def record(self) -> dict:
        """``describe()`` plus the case's ``dtype`` (``"float32"``, ``"bfloat16"``, ...) and ``batch`` (rows): the
        coordinates of the item's JSON record (``--kvconform-json``) and of the run digest."""
        return {**self.describe(), "dtype": self.case.dtype, "batch": self.case.batch}


def in_scope(subject, model: ModelInfo, case, full: bool = True, check=None) -> bool:
    """Whether the item exists at all. A case limited to some models (``models``; ``models_full`` under
    ``--kvconform-full``) or model features
    (``requires``), and a subject that cannot serve a model (``CacheSpec.applies_to``, e.g. QuantizedCache on a
    model with linear-attention layers), generate no item there — listing thousands of such skips would bury the
    ones that say something (a capability the subject lacks, missing hardware, a full-tier case). ``check``: the
    case's ``CheckInfo``, whose ``adapter_full_tier`` keeps it off a model adapter's default tier (None: not
    asked)."""
    from kvconform.cases import model_requirements_unmet

    if (case.tier == "full" or subject.tier == "full") and not full:
        return False  # opt-in tier: counted in the report header instead of listed as skips
    scope = case.model_scope(full)  # models, or models_full under --kvconform-full
    if scope and model.name not in scope and not stands_in_for(model, scope):
        return False
    if model_requirements_unmet(case, model.features):
        return False
    source = model.source
    if (getattr(subject, "adapter_spec", None) or None) != source.adapter_spec:
        return False  # a from-scratch model runs its own caches only, and they run on it only
    if not full and check is not None and not source.in_default_tier(check):
        return False  # its default tier keeps within its time budget (CheckInfo.adapter_full_tier)
    return subject.applies_to is None or subject.applies_to(model) is None


def serves(subject, model: ModelInfo) -> bool:
    """Whether ``subject`` has items on ``model`` at all, whatever the case (``in_scope``'s subject rules): a
    from-scratch model's own caches only on it, and only they; the subject's ``applies_to``."""
    if (getattr(subject, "adapter_spec", None) or None) != model.source.adapter_spec:
        return False
    return subject.applies_to is None or subject.applies_to(model) is None


_ZOO_FEATURES: dict = MEMO.table("plan.zoo_features")


def zoo_features(name: str) -> frozenset:
    """The features (``ModelInfo.features``) of a zoo family, from its config (no weights built; memoised)."""
    if name not in _ZOO_FEATURES:
        _ZOO_FEATURES[name] = frozenset(model_info(name, zoo_only=True, read_forward=False).features)
    return _ZOO_FEATURES[name]


def same_kind(model: ModelInfo) -> list[str]:
    """The zoo families with exactly ``model``'s features (decoder-only or encoder-decoder, attention, sliding
    window, linear-attention state), in zoo order."""
    features = frozenset(model.features) - {"no_padding_mask"}  # a model adapter's own forward, not its kind
    return [name for name in zoo.ZOO_NAMES if zoo_features(name) == features]


def stands_in_for(model: ModelInfo, scope) -> bool:
    """Whether a checkpoint (or a zoo VLM: its text model is of a zoo kind, behind an image prefix) takes the place
    of the zoo models a case is limited to: cases list a few representative zoo families to keep the run short, and
    a checkpoint of the same kind — the same features (decoder-only or
    encoder-decoder, attention, sliding window, linear-attention state) as one of them — gets that case too, so a
    user's checkpoint is checked by every family that applies to its architecture. The zoo's text models never stand
    in."""
    if not external(model.spec) and model.spec not in zoo.VLM_NAMES:
        return False
    return any(name in scope for name in same_kind(model))


def architecture_names() -> set:
    """The names of every architecture ``transformers:*`` would try (``tf_<type>``): known-faults entries may name
    them."""
    from kvconform import architectures

    return {architectures.model_name(t) for t in architectures.known_types()}


def zoo_family(spec: str) -> str | None:
    """The zoo family built from the same model type as ``transformers:<type>`` (``transformers:mamba`` → mamba):
    its source says (``ModelSource.zoo_family``)."""
    return source_of(spec).zoo_family()


def external(spec: str) -> bool:
    """A model outside the zoo: a checkpoint folder, an architecture of transformers (``transformers:TYPE``) or a
    model adapter (its source says so: ``ModelSource.external``)."""
    return source_of(spec).external


def skip_reason(subject, model: ModelInfo, check, case, device: str = "cpu") -> str | None:
    """Why an item that exists (``in_scope``) is skipped, or None: the one place that decides it (see
    ARCHITECTURE.md, "Items"). In order: a model outside what the subject declares it supports (``CacheSpec.supports``,
    ``subjects.unsupported``); a capability the subject does not declare (with its ``notes``); a fact the check
    needs of the subject's kind (``@register(..., facts=...)``: a fake-quant twin, compression, ...); the check's
    own rule (``@register(..., applies=rule)``, ``rule(subject, model, case, device=...) -> reason or None``:
    a declared budget, coverage checks tied to one subject, ...); the subject's kind, where the check does not judge
    it (``CheckInfo.judges``; ``Kind.not_judged``: e.g. a lossy subject is not held to the generate family's
    token-for-token comparison with the exact model, an evicting one keeps only the cases that never make it hold
    more than its ``tokens_max`` tokens, ``most_tokens_held``); ``CacheSpec.requires`` and ``CacheSpec.needs_cuda``
    (optional backends and hardware), ``CacheSpec.cuda_requires`` on CUDA (a program such as ``nvcc``); explicit
    ``position_ids`` on a model whose forward takes none; a case that makes the model see more tokens than its
    position limit (``positions_problem``, from its config).
    """
    from kvconform.compat import missing_requirement
    from kvconform.subjects import kind_of, unsupported

    scoped = unsupported(subject, model)
    if scoped:
        return scoped
    reason = model.source.not_applicable(check, case)  # e.g. a transformers-only check on a from-scratch model
    if reason:
        return reason
    missing = sorted(check.needs - subject.capabilities)
    if missing:
        note = subject.notes.get(missing[0])
        return f"{subject.name} does not declare capability '{missing[0]}'" + (f": {note}" if note else "")
    kind = kind_of(subject)
    reason = check.lacks_fact(kind)
    if reason:
        return reason
    own_rule = check.applies
    reason = own_rule(subject, model, case, device=device) if own_rule is not None else None
    if reason:
        return reason
    if not check.judges_kind(kind):
        reason = kind.not_judged(check, case, held=lambda: most_tokens_held(case, check))
        if reason:
            return reason
    for requirement, hint in subject.requires.items():
        if missing_requirement(requirement):
            return f"requires {requirement} ({hint})"
    if subject.needs_cuda and not _cuda_device(device):
        return subject.needs_cuda
    if _cuda_device(device):
        from kvconform.compat import missing_tool

        for tool, why in subject.cuda_requires.items():
            if missing_tool(tool):
                return f"requires {tool} on CUDA ({why})"
    if case.position_ids == "explicit" and not model.accepts_position_ids and check.reads_position_ids:
        return f"{model.name}'s forward takes no position_ids counted from 0"
    return positions_problem(model, check, case)


_LIMITS: dict = MEMO.table("plan.position_limits")


def position_limit(model: ModelInfo) -> int | None:
    """The most tokens ``model`` can take in one sequence, or None (no limit), decided from its config alone, never
    by running it (memoised per spec): a model written from scratch declares it (its adapter's ``max_positions``);
    otherwise the position count of its config (``compat.position_limit``: ``n_positions``,
    ``max_position_embeddings``, ... where no rotary embedding is declared), kept where the model built on the meta
    device (no weights allocated) has a learned position table (an ``nn.Embedding``) of that many rows, up to two
    more (BART's offset of 2). A config the meta build fails on keeps the candidate: a skip costs less than an
    out-of-range lookup, which on CUDA is a device-side assert that fails every later CUDA call of the process."""
    from kvconform import compat

    if model.spec in _LIMITS:
        return _LIMITS[model.spec]
    declares, declared = model.source.declared_position_limit()
    if declares:
        _LIMITS[model.spec] = declared
        return declared
    config = model.model_config()
    limit = compat.position_limit(config)
    if limit is not None:
        limit = limit if _has_position_table(config, limit) in (True, None) else None
    _LIMITS[model.spec] = limit
    return limit


def _has_position_table(config, limit: int) -> bool | None:
    """Whether the model of ``config``, built on the meta device, has an ``nn.Embedding`` of ``limit`` to
    ``limit + 2`` rows that is not its token embedding, or a 2-D position buffer of as many rows (a name holding
    ``pos``: CTRL's sinusoidal ``pos_encoding``, indexed by position like a table); None when it does not build
    there."""
    import torch

    from kvconform.architectures import auto_model_class

    try:
        with torch.device("meta"):
            model = auto_model_class(config).from_config(config, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - unknown here: the config's count is kept (position_limit)
        return None
    vocab = getattr(config.get_text_config(decoder=True), "vocab_size", None)
    if any(isinstance(m, torch.nn.Embedding) and limit <= m.num_embeddings <= limit + 2
           and m.num_embeddings != vocab for m in model.modules()):
        return True
    # a fixed table kept as a buffer and indexed by position (CTRL's sinusoidal pos_encoding of n_positions rows)
    return any("pos" in name.rsplit(".", 1)[-1] and b.dim() == 2 and limit <= b.shape[0] <= limit + 2
               for name, b in model.named_buffers())


def positions_needed(case, check) -> int:
    """The most tokens one sequence of the item reaches (positions 0 … N−1): ``most_tokens_held``, plus one where
    the case forks (the parked original is decoded once more at the end)."""
    forks = any(op.name == "fork" for op in case.ops)
    return most_tokens_held(case, check) + (1 if forks else 0)


def positions_problem(model: ModelInfo, check, case) -> str | None:
    """Why ``model`` cannot take the item (``positions_needed`` over its ``position_limit``), or None: the model's
    own limit, so the item is skipped rather than failed (or, on CUDA, left to poison its worker)."""
    limit = position_limit(model)
    if limit is None:
        return None
    needed = positions_needed(case, check)
    if needed <= limit:
        return None
    where = model.source.position_limit_where
    return f"{model.name} takes at most {limit} positions ({where}) and case {case.id} makes it see {needed} tokens"


def most_tokens_held(case, check) -> int:
    """The most tokens per row a cache holds while the case runs (an upper bound): what the check declares
    (``@register(..., tokens_held=...)``: a check that feeds tokens of its own, e.g. generate's or the fuzz family's
    longest program), else from the case's ops — ``prefill``, ``chunk`` and ``decode`` add their tokens, ``crop``
    removes (not below 0), ``reset`` empties, batch ops and ``fork`` keep; a case without ops: ``prompt +
    max_new_tokens``."""
    declared = check.tokens_held
    if declared is not None:
        return declared(case)
    if not case.ops:
        return case.prompt + case.max_new_tokens
    return max(tokens_held(case.ops))


def _cuda_device(device: str) -> bool:
    from kvconform.compat import on_cuda

    return on_cuda(device)
