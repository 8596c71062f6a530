"""A vLLM-style page pool owned by the cache object (``kvconform.testing.page_pool.PagePoolCache``), a design
kvconform did not bundle: correct, it passes every family of the default tier on llama with its memory measured
(not 0 bytes); its faulty variants (a leaking pool, block tables kept by ``reset``) are pinned in
``tests/caches/test_faulty_caches.py`` (their ``FAULTY`` entries)."""

from __future__ import annotations

from collections import Counter

from kvconform.api import check_cache
from kvconform.testing.page_pool import PagePoolCache


def test_correct_page_pool_passes_every_family_on_llama_with_its_bytes_measured():
    results = check_cache(PagePoolCache, models=["llama"])
    bad = [(r.check, r.case, r.message) for r in results if r.outcome not in ("passed", "skipped")]
    assert not bad, bad
    ran = Counter(r.family for r in results if r.outcome == "passed")
    assert {"logits", "crop", "batch", "lifecycle", "memory", "contract"} <= set(ran), ran
    memory = [r for r in results if r.check == "check_memory_bytes" and r.outcome == "passed"]
    assert memory and all(r.metrics["bytes_held"] > 0 and r.metrics["bytes_shared"] == r.metrics["bytes_held"]
                          for r in memory), [(r.case, r.metrics.get("bytes_held")) for r in memory]
    assert not [r for r in results if "blind" in (r.metrics or {})]
