"""kvconform's selftest (``--kvconform-selftest``): each bundled faulty cache must be caught by its target check
on the installed transformers. An item passes when the fault is caught."""

import pytest


@pytest.mark.kvconform
def test_selftest(kv_selftest, kv_session, request):
    from kvconform.report import encode_property
    from kvconform.session import run_selftest

    result = run_selftest(kv_session, kv_selftest)
    request.node.user_properties.append(("kvconform_selftest", encode_property(
        {k: result[k] for k in ("name", "family", "check", "caught", "items", "failed")})))
    assert result["caught"], (
        f"faulty cache {kv_selftest.name} ({kv_selftest.spec}) was NOT caught by {kv_selftest.check} on "
        f"{kv_selftest.model}: {result['items']} item(s) ran, none failed")
