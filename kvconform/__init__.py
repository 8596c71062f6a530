"""kvconform: does a KV cache give the same logits as no cache, stay small and fast? (a pytest plugin)

Run ``pytest --kvconform``. The public Python API is in the submodules: ``kvconform.reference.ReferenceCache``,
``kvconform.subjects.CacheSpec``, ``kvconform.checks``. Importing this package imports neither torch nor
transformers.
"""

__version__ = "0.1.0"
