"""``transformers:PATTERN``: the architectures of the installed transformers the pattern matches, each built tiny
from its default config (``sweep.survey``; ``kvconform.architectures``)."""

from __future__ import annotations

from kvconform.sources.base import ModelSource, register_source


@register_source
class ArchitectureSource(ModelSource):
    """A ``transformers:PATTERN`` spec (a sweep), and each ``transformers:<model_type>`` it stands for."""

    name = "architecture"
    order = 10

    @classmethod
    def recognises(cls, spec) -> bool:
        from kvconform.architectures import is_architecture_spec

        return is_architecture_spec(spec)

    @property
    def model_type(self) -> str:
        """The model type after ``transformers:`` (one architecture; a pattern for the sweep's spec)."""
        from kvconform.architectures import PREFIX

        return self.spec.removeprefix(PREFIX)

    def config(self, trust_remote_code: bool = False):
        """The architecture's tiny default config (``architectures.tiny_config``)."""
        from kvconform import architectures

        return architectures.tiny_config(self.model_type)

    def build(self, dtype, device: str = "cpu", trust_remote_code: bool = False):
        """The architecture built tiny with seeded weights (``zoo.build_architecture``)."""
        from kvconform import zoo

        return zoo.build_architecture(self.model_type, dtype=dtype, device=device)

    def zoo_family(self) -> str | None:
        """The zoo family of the same model type (``transformers:mamba`` → ``mamba``), or None."""
        from kvconform import zoo

        return next((name for name in zoo.ZOO_NAMES if zoo.zoo_config_type(name) == self.model_type), None)
