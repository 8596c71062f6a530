"""What a model *is* for a run: its source (``ModelSource``), one class per kind of ``--kvconform-model`` value, and
``ModelInfo``, what collection knows of a model without building it (it carries its source).

A source class owns, in one place: recognising its spec (``recognises``) and what is wrong with it
(``problem``: the whole usage-error message, naming the spec and the fix), building the model at a dtype and
device (``build``), whether the ReferenceCache runs on it (``has_reference``), whether transformers' known faults
apply to it (``transformers_faults``), the subjects it brings (``own_subjects``) and which checks do not apply to
it and why (``not_applicable``). Callers (``plan``, ``session``, ``workers``, ``options``) ask the source object
(``source_of(spec)`` or ``ModelInfo.source``) instead of testing the spec string. Imports neither torch nor
transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

SOURCES: list[type[ModelSource]] = []
"""The registered source classes, in the order they are asked (``order``, then registration)."""


def register_source(cls: type[ModelSource]) -> type[ModelSource]:
    """Class decorator registering a ``ModelSource`` subclass; ``source_of`` asks the classes by their ``order``
    (the first whose ``recognises(spec)`` is True names the spec).

    Raises:
        TypeError: ``cls`` is no ``ModelSource`` subclass or has no ``name``.
    """
    if not (isinstance(cls, type) and issubclass(cls, ModelSource)) or not getattr(cls, "name", ""):
        raise TypeError(f"register_source: {cls!r} must be a ModelSource subclass with a name")
    SOURCES[:] = sorted([*(c for c in SOURCES if c.name != cls.name), cls], key=lambda c: c.order)
    return cls


def source_of(spec: str) -> ModelSource:
    """The source of the ``--kvconform-model`` value ``spec``: an instance of the first registered class (by
    ``order``) that recognises it.

    Raises:
        ValueError: no registered class recognises it (the zoo source recognises every string: not raised then).
    """
    import kvconform.sources  # noqa: F401 - registers the built-in sources

    for cls in SOURCES:
        if cls.recognises(spec):
            return cls(spec)
    raise ValueError(f"--kvconform-model {spec!r}: no model source recognises it")


class ModelSource:
    """One kind of model a ``--kvconform-model`` value names (subclass it and decorate with ``register_source``).

    Attributes:
        spec: the ``--kvconform-model`` value.
        name: the source's name (``"zoo"``, ``"checkpoint"``, ``"architecture"``, ``"adapter"``).
        order: where ``source_of`` asks it (lower first): a source recognising a subset of another's specs asks
            first.
        has_reference: the ReferenceCache runs on its model (a transformers model).
        transformers_faults: transformers' known faults (``known_faults.toml``) may apply to its items.
        runs_in_process: a run of models of this source alone stays in process (no xdist workers: starting one
            costs more than its items).
        brings_subjects: its model comes with caches of its own (``own_subjects``), so ``--kvconform-subject`` may
            name subjects the run does not know yet.
        position_limit_where: where its position limit comes from, for the skip reason.
        external: a model outside the zoo: a case scoped to zoo models reaches it through the zoo models of its kind
            (``plan.stands_in_for``), and so do known faults naming every zoo model of its kind.
    """

    name: ClassVar[str] = ""
    order: ClassVar[int] = 100
    has_reference: ClassVar[bool] = True
    transformers_faults: ClassVar[bool] = True
    runs_in_process: ClassVar[bool] = False
    brings_subjects: ClassVar[bool] = False
    position_limit_where: ClassVar[str] = "its config: a learned position table"
    external: ClassVar[bool] = True

    def __init__(self, spec: str):
        self.spec = spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    @classmethod
    def recognises(cls, spec) -> bool:
        """Whether ``spec`` (a ``--kvconform-model`` value) names a model of this source."""
        raise NotImplementedError

    def problem(self, trust_remote_code: bool = False) -> str | None:
        """Why the spec cannot be used, from the file system and the spec alone (no torch or transformers import),
        or None: the whole usage-error message, naming the spec and the fix."""
        return None

    def info(self) -> ModelInfo | None:
        """``ModelInfo`` where the source knows it without a transformers config (a model adapter), else None
        (``plan.model_info`` reads the config)."""
        return None

    def folder(self) -> str | None:
        """The checkpoint folder its config and weights are read from (``config.json``: ``plan.model_info``; loaded
        and refused when not causal when the session is built), or None: a model built from a config in code."""
        return None

    def config(self, trust_remote_code: bool = False):
        """Its transformers config (no weights built).

        Raises:
            NotImplementedError: the source has none (a model adapter) or does not say how to read it.
        """
        raise NotImplementedError(f"a model of source {self.name!r} ({self.spec!r}) has no transformers config")

    def build(self, dtype, device: str = "cpu", trust_remote_code: bool = False):
        """The model at ``dtype`` (a ``torch.dtype``) on ``device``, as a ``zoo.ZooModel``.

        Raises:
            NotImplementedError: the source does not say how to build its model (each built-in source does).
        """
        raise NotImplementedError(f"source {self.name!r} does not build {self.spec!r}")

    def zoo_family(self) -> str | None:
        """The zoo family built from the same model type (``transformers:mamba`` → ``mamba``), whose known faults and
        inherited faults it shares (``session.KVSession``), or None (here: none)."""
        return None

    @property
    def adapter_spec(self) -> str | None:
        """The model adapter spec whose own caches alone run on this model (``CacheSpec.adapter_spec``), or None:
        the run's subjects run on it."""
        return None

    def own_subjects(self) -> list:
        """The caches its model comes with, as ``CacheSpec`` s (none here)."""
        return []

    def not_applicable(self, check, case) -> str | None:
        """Why ``check`` (a ``CheckInfo``) on ``case`` cannot apply to a model of this source, or None."""
        return None

    def in_default_tier(self, check) -> bool:
        """Whether ``check`` (a ``CheckInfo``) runs on its model in the default tier (else only under
        ``--kvconform-full``)."""
        return True

    def declared_position_limit(self) -> tuple[bool, int | None]:
        """``(declared, limit)``: whether the source declares its position limit itself (then ``limit``, or None
        for none) rather than the model's config telling it (``plan.position_limit``)."""
        return False, None


@dataclass(frozen=True)
class ModelInfo:
    """What collection needs to know about a model without building its weights."""

    name: str
    spec: str
    layer_types: tuple
    is_encoder_decoder: bool
    accepts_position_ids: bool
    trust_remote_code: bool = False
    """Load it with its repository's own code (``--kvconform-trust-remote-code``; ``remote.py``)."""
    takes_mask: bool = True
    """Whether its forward takes a padding mask: False only for a model adapter declaring ``takes_mask = False``
    (``kvconform.scratch``); such a model has the feature ``no_padding_mask``, which the unpadded twins of the
    left-padded batch and low-precision cases require."""

    @property
    def source(self) -> ModelSource:
        """Its source (``source_of(spec)``): what kind of model it is, asked instead of its spec string."""
        return source_of(self.spec)

    def model_config(self):
        """Its transformers config, read by its source (``ModelSource.config``; no weights built).

        Raises:
            Exception: whatever reading it raises (a model adapter has none).
        """
        return self.source.config(self.trust_remote_code)

    @property
    def features(self) -> set:
        from kvconform.zoo import ZooModel

        features = set(ZooModel(self.name, None, None, None, self.is_encoder_decoder, self.layer_types, None).features)
        return features if self.takes_mask else features | {"no_padding_mask"}
