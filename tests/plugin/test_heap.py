"""The cyclic garbage collector around a session build (``workers.collector_paused_while_building``): paused while
torch and transformers are imported and the plan is made, what the build leaves frozen, running again for the items."""

import gc
import textwrap

import pytest

from kvconform.workers import collector_paused_while_building


class _Node:
    """A tracked object (in a reference cycle with itself)."""

    def __init__(self):
        self.me = self


def test_the_collector_is_paused_inside_and_what_was_built_is_frozen_after():
    assert gc.isenabled()
    with collector_paused_while_building():
        assert not gc.isenabled()
        kept = [_Node() for _ in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(kept)
    walked = {id(o) for o in gc.get_objects()}  # the generations the collector walks; not the frozen ones
    assert not any(id(n) in walked for n in kept)


def test_a_build_that_raises_freezes_nothing_and_the_collector_runs_again():
    made = []
    with pytest.raises(RuntimeError, match="bad spec"):
        with collector_paused_while_building():
            made.extend(_Node() for _ in range(100))
            raise RuntimeError("bad spec")
    assert gc.isenabled()
    walked = {id(o) for o in gc.get_objects()}  # not frozen: still in the generations the collector walks
    assert all(id(n) in walked for n in made)


def test_a_collector_the_caller_disabled_stays_disabled():
    gc.disable()
    try:
        with collector_paused_while_building():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_items_run_with_the_collector_on_and_the_build_frozen(run_kvconform, pytester):
    # what the subject's factory sees of the collector is what the build (or an item) that calls it sees
    pytester.makepyfile(probe=textwrap.dedent("""
        import gc
        from transformers import DynamicCache

        def make(config, **kw):
            with open("gc.txt", "a") as fh:
                fh.write(f"{gc.isenabled()} {gc.get_freeze_count()}\\n")
            return DynamicCache(config=config)
    """))
    result = run_kvconform("-n", "0", "--kvconform-cache", "probe:make", "--kvconform-model", "llama",
                           "-k", "decode_implicit_positions")
    assert result.ret == 0, result.stdout.str()
    calls = [tuple(line.split()) for line in (pytester.path / "gc.txt").read_text().splitlines()]
    # the session build calls the factory once (its signature and capabilities are read then): collector paused
    building = [c for c in calls if c[0] == "False"]
    items = [c for c in calls if c[0] == "True"]
    assert building and items, calls
    assert calls[:len(building)] == building
    # the items: collector on; torch, transformers and the plan frozen (hundreds of thousands of objects it no
    # longer walks)
    assert all(int(frozen) > 100_000 for _, frozen in items), calls
