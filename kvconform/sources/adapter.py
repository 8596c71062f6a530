"""``MODULE:ATTR`` or ``FILE.py:ATTR``: a model written from scratch, through its adapter (``kvconform.scratch``)."""

from __future__ import annotations

from kvconform import scratch
from kvconform.sources.base import ModelInfo, ModelSource, register_source


@register_source
class AdapterSource(ModelSource):
    """A model adapter (``kvconform.scratch``): its model is no transformers model, so the ReferenceCache does not
    run on it and transformers' known faults do not apply; it brings its own caches, which run on it alone; checks
    that judge transformers' own API (``register(..., transformers_only=reason)``) do not apply to it."""

    name = "adapter"
    order = 20
    has_reference = False
    transformers_faults = False
    runs_in_process = True
    brings_subjects = True
    position_limit_where = "its adapter's max_positions"

    @classmethod
    def recognises(cls, spec) -> bool:
        return scratch.is_scratch_spec(spec)

    def problem(self, trust_remote_code: bool = False) -> str | None:
        return scratch.spec_problem(self.spec)

    def info(self) -> ModelInfo:
        """Raises ``scratch.AdapterUsageError``: the adapter does not load (``scratch.load_adapter``)."""
        adapter = scratch.load_adapter(self.spec)
        return ModelInfo(scratch.model_name(adapter), self.spec, scratch.layer_types(adapter),
                         scratch.is_encoder_decoder(adapter), False,
                         takes_mask=scratch.takes_mask(adapter))

    def build(self, dtype, device: str = "cpu", trust_remote_code: bool = False):
        return scratch.build_model(self.spec, dtype=dtype, device=device)

    @property
    def adapter_spec(self) -> str | None:
        return self.spec

    def own_subjects(self) -> list:
        """The adapter's caches (``scratch.subjects``), after checking that its uncached forward can be the float64
        oracle.

        Raises:
            scratch.AdapterUsageError: the float64 forward fails (``scratch.float64_problem``).
        """
        problem = scratch.float64_problem(self.spec)
        if problem:
            raise scratch.AdapterUsageError(f"--kvconform-model {self.spec!r}: {problem}")
        return scratch.subjects(self.spec)

    def not_applicable(self, check, case) -> str | None:
        """The check's own reason where it judges transformers' own API (``register(..., transformers_only=...)``),
        else the adapter's (``scratch.not_applicable``: what it declares)."""
        if check.transformers_only:
            return f"not for a model outside transformers: {check.transformers_only}"
        return scratch.not_applicable(check, case, self.spec)

    def in_default_tier(self, check) -> bool:
        return not check.adapter_full_tier  # its default tier keeps within its time budget (the check says so)

    def declared_position_limit(self) -> tuple[bool, int | None]:
        declared = getattr(scratch.load_adapter(self.spec), "max_positions", None)
        return True, int(declared) if declared else None
