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
