"""A cache that cannot run a memory or compression case at batch 2 is measured at batch 1 as well, so its bytes
get a verdict: a correct one-row cache fails only for the refused batch (its bytes within the bound at batch 1, said
so), a faulty one fails for its bytes at batch 1."""

from __future__ import annotations

from kvconform.api import check_cache

_M = "kvconform.testing.single_row"


def _one(attr, check, case):
    [result] = check_cache(f"{_M}:{attr}", models=["llama"], checks=[check], cases=[case])
    return result


def test_a_correct_one_row_cache_fails_for_the_batch_and_its_bytes_are_within_at_batch_one():
    r = _one("SingleRowCache", "check_memory_bytes", "memory_decode")
    assert r.outcome == "failed"
    lines = r.message.splitlines()
    assert lines[0].endswith("(fp32, batch 2), case memory_decode")
    assert lines[1] == ("  at batch 1 it runs, and its bytes are within the bound: 4,096 B held vs 4,096 B by the "
                        "formula (1.0×) after S=8 tokens")
    assert "the subject raised ValueError: this cache serves one sequence at a time" in r.message


def test_a_one_row_cache_holding_too_much_fails_for_its_bytes_at_batch_one():
    r = _one("SingleRowKeepsHistory", "check_memory_bytes", "memory_decode")
    assert r.outcome == "failed"
    lines = r.message.splitlines()
    assert lines[0].endswith("(fp32, batch 1), case memory_decode")
    assert lines[1].startswith("  measured at batch 1: at batch 2 the subject raised ValueError at prefill(12)")
    assert "layer 0 holds 9,216 B, but should hold ≤ 1,792 B (6.00× the formula)" in r.message
    assert r.metrics["measured_batch"] == 1 and r.metrics["raised_at_batch"] == 2


def test_a_one_row_lossy_cache_gets_its_compression_verdict_at_batch_one():
    r = _one("SingleRowCodecClaimsSaving", "check_compression_real", "compression_long")
    assert r.outcome == "failed"
    assert "(fp32, batch 1), case compression_long" in r.message.splitlines()[0]
    assert "held bytes = 122,880 B after 240 tokens, 1.000× the 122,880 B an exact cache must hold" in r.message


def test_a_cache_that_raises_at_batch_one_too_keeps_its_batch_two_failure():
    from kvconform.subjects import CacheSpec
    from kvconform.testing.single_row import SingleRowCache

    class Broken(SingleRowCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self.get_seq_length() >= 14:
                raise RuntimeError("ring full")
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    [r] = check_cache(CacheSpec("Broken", Broken), models=["llama"], checks=["check_memory_bytes"],
                      cases=["memory_decode"])
    lines = r.message.splitlines()
    assert lines[0].endswith("(fp32, batch 2), case memory_decode")
    assert lines[1] == "  at batch 1 it raises too (RuntimeError at chunk(4)): no bytes measured"
    assert "the subject raised ValueError: this cache serves one sequence at a time" in r.message
