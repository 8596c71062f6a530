"""Every built-in subject can do what it declares: each declared capability is exercised on a fresh instance built
for a zoo config on this CPU (the offloaded caches build without a GPU: only their forwards need one), so a
declaration that a fresh cache cannot honour — ``deepcopy`` of a cache holding a ``torch.Stream`` — is caught here,
not on the first GPU run, where every prefix-fork item of the subject would fail unexplained."""

import copy

import pytest

from kvconform import compat, zoo
from kvconform.subjects import builtin_subjects

METHODS = {"crop": "crop", "reorder": "reorder_cache", "batch_repeat": "batch_repeat_interleave",
           "batch_select": "batch_select_indices", "reset": "reset"}
"""The cache method a capability calls (the op table's ``cache method``); ``deepcopy`` is ``copy.deepcopy``."""


def _exercise(cache, capability: str) -> None:
    """Raise where ``cache`` (fresh, empty) cannot honour ``capability``."""
    if capability == "deepcopy":
        twin = copy.deepcopy(cache)
        assert type(twin) is type(cache)
    elif capability == "reset":
        cache.reset()
    elif capability in METHODS:
        assert callable(getattr(cache, METHODS[capability], None)), f"no {METHODS[capability]}()"
    elif capability == "compile":
        assert isinstance(cache.is_compileable, bool)


def _available(spec) -> bool:
    return not any(compat.missing_requirement(r) for r in spec.requires)


SPECS = [s for s in builtin_subjects() if _available(s)]


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_every_declared_capability_works_on_a_fresh_instance(spec):
    config = zoo.zoo_config("llama")
    failures = []
    for capability in sorted(spec.capabilities - {"forward", "generate"}):
        try:
            _exercise(spec.plan_build(config), capability)
        except Exception as exc:  # noqa: BLE001 - each failure is reported with its capability
            failures.append(f"{capability}: {type(exc).__name__}: {exc}")
    assert not failures, f"{spec.name} declares what a fresh instance cannot do: {failures}"


def test_the_offloaded_caches_are_exercised_on_cpu_and_say_why_they_do_not_fork():
    offloaded = {s.name: s for s in SPECS if s.same_as}
    assert set(offloaded) == {"DynamicCache_offloaded", "StaticCache_offloaded"}
    for spec in offloaded.values():
        cache = spec.plan_build(zoo.zoo_config("llama"))
        assert cache.offloading  # really an offloaded cache, built without a GPU
        try:
            copy.deepcopy(cache)
        except TypeError:  # transformers 5.25: its prefetch torch.Stream cannot be pickled
            assert "deepcopy" not in spec.capabilities and "torch.Stream" in spec.notes["deepcopy"], spec.notes
        else:
            assert "deepcopy" in spec.capabilities
    # they move their buffers between devices every step: no compile claim, whatever is_compileable says
    for spec in offloaded.values():
        assert "compile" not in spec.capabilities and "static address" in spec.notes["compile"]


def test_the_builtin_names_read_without_torch_are_the_builtin_subjects():
    """``BUILTIN_NAMES`` (what an xdist controller checks ``--kvconform-subject`` against before any worker starts)
    names exactly the built-in subjects, in their order."""
    from kvconform.subjects import builtin_subjects
    from kvconform.subjects.builtin import BUILTIN_NAMES

    assert BUILTIN_NAMES == tuple(s.name for s in builtin_subjects())
