"""A local checkpoint folder (``config.json`` and weights; ``zoo.load_checkpoint``), its repository's own code
only with ``--kvconform-trust-remote-code`` (``kvconform.remote``)."""

from __future__ import annotations

import os

from kvconform import zoo
from kvconform.sources.base import ModelSource, register_source


@register_source
class CheckpointSource(ModelSource):
    """A folder: anything written as a path (``./llama``, ``~/m``, ``ckpt/llama``), or a bare word that is no zoo
    name (``zoo.is_checkpoint_spec``). Asked last: what no other source recognises is a folder."""

    name = "checkpoint"
    order = 90

    @classmethod
    def recognises(cls, spec) -> bool:
        return isinstance(spec, str) and zoo.is_checkpoint_spec(spec)

    def folder(self) -> str | None:
        return os.path.expanduser(self.spec)

    def config(self, trust_remote_code: bool = False):
        """The folder's ``config.json`` (``zoo.checkpoint_config``)."""
        return zoo.checkpoint_config(self.spec, trust_remote_code)

    def build(self, dtype, device: str = "cpu", trust_remote_code: bool = False):
        """The folder's model and weights (``zoo.load_checkpoint``)."""
        return zoo.load_checkpoint(os.path.expanduser(self.spec), dtype=dtype, device=device,
                                   trust_remote_code=trust_remote_code)

    def problem(self, trust_remote_code: bool = False) -> str | None:
        """A folder that is not a checkpoint (no config.json, no weights), a bare word that is neither a zoo name
        nor a folder (with the closest zoo name, and the adapter form where it looks like a module path), a folder
        that ships its own code without ``trust_remote_code``; or None."""
        from kvconform import remote

        spec = self.spec
        path = os.path.expanduser(spec)
        problem = zoo.checkpoint_problem(path)
        if problem == "no such folder" and os.sep not in spec and "/" not in spec:
            import difflib

            close = difflib.get_close_matches(spec.lower(), zoo.ALL_NAMES, 1, cutoff=0.6)
            problem = (f"not a zoo name{f' (did you mean {close[0]!r}?)' if close else ''} and not a checkpoint "
                       f"folder; zoo names: {', '.join(zoo.ZOO_NAMES)} (and {', '.join(zoo.VLM_NAMES)}, the "
                       f"vision-language models)")
            if "." in spec.strip("."):  # a module path: a model adapter is named with a colon before its class
                module, _, attr = spec.rpartition(".")
                problem += f"; a model written from scratch is named MODULE:ATTR, e.g. {module}:{attr}"
        if problem:
            return f"--kvconform-model {spec!r}: {problem}"
        return remote.consent_problem(spec, path, trust_remote_code)
