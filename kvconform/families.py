"""The check families, in matrix-column order: the one list the registry (``kvconform.checks``), the pytest markers
(``kvconform.plugin``, which must not import torch) and the bundled faulty caches read.

A check registered under another family is appended after these in the matrix; a new built-in family is added here
(its marker follows).
"""

FAMILIES = ("logits", "generate", "crop", "speculative", "prefix", "batch", "lifecycle", "contract", "fuzz", "quality",
            "coverage", "compile", "memory", "speed")
"""Check families in matrix-column order."""
