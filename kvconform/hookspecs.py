"""kvconform's own pytest hooks (registered by the plugin with ``pytest_addhooks``)."""


def pytest_kvconform_caches(config):
    """Return extra subjects for the kvconform suite (implement in a ``conftest.py``).

    Return a list whose entries are ``kvconform.CacheSpec`` objects, ``transformers.Cache`` subclasses, factories
    or ``"module:attr"`` strings; they are added to the subjects exactly like ``--kvconform-cache``. Called once in
    ``pytest_configure``; every implementation's list is used.
    """
