"""kvconform: does a KV cache give the same logits as no cache, and stay small and fast? (a pytest plugin)

Run ``pytest --kvconform``. For scripts and a cache author's own tests: ``kvconform.check_cache``,
``kvconform.parametrize_with_checks``, ``kvconform.CacheSpec``, ``kvconform.ReferenceCache``.
Importing this package imports neither torch nor transformers; those names load on first use.
"""

__version__ = "0.1.0"

_LAZY = {
    "check_cache": "kvconform.api",
    "parametrize_with_checks": "kvconform.api",
    "CheckResult": "kvconform.api",
    "RunOptions": "kvconform.run_options",
    "CacheSpec": "kvconform.subjects",
    "Budget": "kvconform.subjects",
    "ReferenceCache": "kvconform.reference",
    "ConformanceError": "kvconform.checks",
    "KVConformError": "kvconform.outcomes",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvconform' has no attribute {name!r}")
