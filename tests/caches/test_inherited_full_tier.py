"""No inherited fault unexcused in the full tier: a correct cache built on transformers' own layers — a
``DynamicCache`` subclass that adds nothing, once as an exact subject and once declared lossy (so the checks of the
non-exact kinds run on it too: ``check_identity_ops``, ``check_padded_row_alone``) — gets 0 failures on the zoo's
linear-attention and hybrid models over the checks that reach transformers' batch, reset and identity faults.

Before: 28 failures on transformers 5.24 (``linear-reset-other-batch`` and ``falcon-h1-hybrid-batch-ops`` scoped to
``DynamicCache`` by name with no ``inherits``: 26; ``linear-no-batch-ops`` without ``check_identity_ops``: 1;
``check_padded_row_alone`` running jamba at float64 without the oracle's preparation, which raised in its MoE experts
with no cache at all: 1). Each excused failure must say which transformers method it inherits.
"""

from __future__ import annotations

import collections

from transformers import DynamicCache

from kvconform.api import check_cache

MODELS = ["mamba", "mamba2", "jamba", "bamba", "falcon_h1"]
CHECKS = ["check_reset_then_reuse", "check_repeat_then_decode", "check_select_then_decode",
          "check_length_bookkeeping", "check_api_contract", "check_identity_ops", "check_padded_row_alone"]


class PlainDynamicCache(DynamicCache):
    """transformers' ``DynamicCache``, subclassed with nothing added: a user's cache that uses transformers' layers
    unchanged."""


class PlainLossyDynamicCache(DynamicCache):
    """The same, declared lossy (it is exact in fact): judged by the checks of the non-exact kinds as well."""

    kvconform_lossy = {"kl_max": 0.5, "top1_min": 0.3}


def test_a_cache_built_on_transformers_layers_gets_no_failure_in_the_full_tier():
    results = check_cache([PlainDynamicCache, PlainLossyDynamicCache], models=MODELS, checks=CHECKS, full=True)
    outcomes = collections.Counter(r.outcome for r in results)
    failed = [f"{r.subject} {r.model} {r.check} {r.case}:\n{r.message}" for r in results
              if r.outcome in ("failed", "error")]
    assert not failed, "\n\n".join(failed)
    xfailed = [r for r in results if r.outcome == "xfailed"]
    assert xfailed and outcomes["passed"], outcomes
    # a user's cache is excused only by evidence: the transformers method it inherits, named
    assert all("inherited from transformers' " in r.message for r in xfailed), \
        [r.message for r in xfailed if "inherited from transformers' " not in r.message]
    # the checks of the non-exact kinds ran on the hybrids (not skipped): jamba's float64 model is prepared as the
    # oracle's, and identity_ops meets transformers' missing batch ops as a known fault
    ran = {(r.model, r.check) for r in results if r.outcome != "skipped" and r.subject == "PlainLossyDynamicCache"}
    assert {("jamba", "check_padded_row_alone"), ("jamba", "check_identity_ops"),
            ("falcon_h1", "check_padded_row_alone")} <= ran, sorted(ran)
