"""A zoo family (``kvconform.zoo``): a bare word naming one of the tiny seeded models built from a config."""

from __future__ import annotations

import os

from kvconform import zoo
from kvconform.sources.base import ModelSource, register_source


@register_source
class ZooSource(ModelSource):
    """A zoo family name (``llama``, ``gpt2``, ...; ``zoo.ALL_NAMES``): a transformers model with seeded weights."""

    name = "zoo"
    order = 30
    external = False

    @classmethod
    def recognises(cls, spec) -> bool:
        return isinstance(spec, str) and not spec.startswith("transformers:") and not zoo.is_checkpoint_spec(spec)

    def config(self, trust_remote_code: bool = False):
        """The family's tiny config (``zoo.zoo_config``)."""
        return zoo.zoo_config(self.spec)

    def build(self, dtype, device: str = "cpu", trust_remote_code: bool = False):
        """The family's seeded model (``zoo.build_zoo_model``)."""
        return zoo.build_zoo_model(self.spec, dtype=dtype, device=device)

    def problem(self, trust_remote_code: bool = False) -> str | None:
        if os.path.isfile(os.path.join(self.spec, "config.json")):
            return (f"--kvconform-model {self.spec!r}: both a zoo family and a checkpoint folder here; write "
                    f"./{self.spec} for the folder")
        return None
