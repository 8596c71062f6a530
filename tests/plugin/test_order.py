"""Tests pass in any order and any subset: a model built in-process inside a pytester test (which snapshots
``sys.modules`` and drops what the test imported) does not break the next model import (tests/conftest.py keeps the
modules that register native state, e.g. ``torch.distributed``'s ``c10d_functional`` library). Each test builds its
model in a fresh pytester scope, so whichever runs second re-imports what the first one's scope dropped."""

import pytest


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_model_built_inside_a_pytester_test_leaves_the_next_import_working(pytester, family):
    from kvconform.zoo import build_zoo_model

    zm = build_zoo_model(family)
    assert zm.model is not None and zm.vocab_size > 0
