"""Model sources: what a ``--kvconform-model`` value names, as a registered class (``kvconform.sources.base``).

The built-in sources, asked in this order: ``architecture`` (``transformers:PATTERN``), ``adapter`` (a model written
from scratch, ``MODULE:ATTR``), ``zoo`` (a zoo family), ``checkpoint`` (a local folder: what no other recognises).
Every module of this package is imported here (a new source is one module with a ``@register_source`` class).
"""

from __future__ import annotations

import importlib
import pkgutil

from kvconform.sources.base import SOURCES, ModelInfo, ModelSource, register_source, source_of  # noqa: F401

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")
