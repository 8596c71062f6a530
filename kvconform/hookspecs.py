"""kvconform's own pytest hooks (registered by the plugin with ``pytest_addhooks``)."""


def pytest_kvconform_caches(config):
    """Return extra subjects for the kvconform suite (implement in a ``conftest.py``).

    Return a list whose entries are ``kvconform.CacheSpec`` objects, ``transformers.Cache`` subclasses, factories
    or ``"module:attr"`` strings; they are added to the subjects exactly like ``--kvconform-cache``. A model adapter
    (``kvconform.scratch``: an object or class with ``build``, ``new_cache``, ``forward``, ``forward_uncached``) is
    added to the models instead, its own caches as its subjects. Called once in
    ``pytest_configure``; every implementation's list is used.
    """
