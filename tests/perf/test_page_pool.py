"""The memory family counts what a cache owns, once: a page pool kept on the cache object (its layers reach it by a
back-reference) is measured at its real size and judged against the formula; state the model owns is not the
cache's; and a cache whose bytes kvconform cannot see at all is not a pass (``blind``)."""

from __future__ import annotations

import torch

import kvconform
from kvconform.checks._measure import cache_bytes, layer_bytes, owned_by_model
from kvconform.examples.tiny_decoder import TinyDecoder
from kvconform.testing.page_pool import LeakyPagePoolCache, PagePoolCache
from kvconform.zoo import build_zoo_model

MEMORY = dict(checks=["check_memory_bytes"], cases=["memory_decode"])
RELEASED = dict(checks=["check_memory_released"], cases=["memory_released"])

# llama of the zoo: 2 layers, 2 K/V heads of 16, float32. One page (4 tokens of one row, all layers, K and V):
PAGE_BYTES = 2 * 2 * 2 * 4 * 16 * 4  # 2,048 B


def _one(results):
    (result,) = [r for r in results if r.outcome != "skipped"]
    return result


def test_the_pool_on_the_cache_object_is_counted_once_and_not_per_layer():
    zm = build_zoo_model("llama")
    cache = PagePoolCache(zm.model.config)
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        zm.model(input_ids=ids, past_key_values=cache, use_cache=True)
    per_layer, shared = cache_bytes(cache, owned_by_model(zm.model))
    assert per_layer == {"layer 0": 0, "layer 1": 0}  # the layers own nothing: the pool is the cache object's
    assert layer_bytes(cache) == per_layer
    assert shared == 2 * 3 * PAGE_BYTES  # 2 rows × ceil(10 / 4) pages, counted once though both layers reach it


def test_a_pool_every_layer_holds_directly_is_counted_once_too():
    # a pool object each layer keeps a reference to (no back-reference to the cache): a storage two layers reach is
    # no layer's own, so it is the cache object's, once — it was charged to every layer (a newcomer's false alarm:
    # 2x the formula on a correct paged cache with copy-on-write)
    from types import SimpleNamespace

    pool = SimpleNamespace(pages=[torch.zeros(4, 16) for _ in range(3)])  # 3 pages of 256 B
    layers = [SimpleNamespace(pool=pool, table=torch.zeros(2, dtype=torch.long)) for _ in range(2)]  # 16 B own each
    cache = SimpleNamespace(layers=layers)
    per_layer, shared = cache_bytes(cache)
    assert per_layer == {"layer 0": 16, "layer 1": 16} and shared == 3 * 256
    assert sum(per_layer.values()) + shared == 3 * 256 + 2 * 16  # every storage once


def test_page_pool_passes_memory_with_the_bytes_of_its_pages():
    """By hand: S = 12, 16, 24 fill whole pages (the formula exactly); after reset, S = 6 takes 2 pages a row
    (8,192 B against 6,144 B, within one page per row and layer), S = 8 fills them again."""
    result = _one(kvconform.check_cache(PagePoolCache, models=["llama"], **MEMORY))
    assert result.outcome == "passed", result.message
    assert [row[1:] for row in result.metrics["per_op"]] == [
        [12, 12288, 12288], [16, 16384, 16384], [24, 24576, 24576], [6, 8192, 6144], [8, 8192, 8192]]
    assert result.metrics["bytes_shared"] == 8192
    assert result.metrics["measured"]["bytes_held"] == 8192 and result.metrics["measured"]["tokens_held"] == 8
    assert result.metrics["granularity"].startswith("pages of 4 tokens, declared")


def test_page_pool_that_leaks_its_pages_fails_memory_naming_the_cache_object():
    result = _one(kvconform.check_cache(LeakyPagePoolCache, models=["llama"], **MEMORY))
    assert result.outcome == "failed"
    # 12 pages of the first sequence never freed + 4 of the second: 16 pages against 6 tokens' formula
    assert "cache object (shared by its layers) holds 32,768 B" in result.message, result.message
    assert result.metrics["bytes_held"] == 16 * PAGE_BYTES and result.metrics["bytes_formula"] == 6144
    assert result.metrics["failed_at"] == "prefill(6)"
    assert "likely cause: pages are not freed by reset()" in result.message


def test_page_pool_released_after_each_request_passes_with_real_bytes_measured():
    result = _one(kvconform.check_cache(PagePoolCache, models=["llama"], **RELEASED))
    assert result.outcome == "passed", result.message
    assert result.metrics["kept_bytes"] == 0
    assert result.metrics["bytes_held"] == 2 * 4 * PAGE_BYTES  # 16 tokens a row: 4 pages a row, 2 rows


# ------------------------------------------------------------------------------------------ the model's own state
class RotaryTableDecoder(TinyDecoder):
    """TinyDecoder whose setup call (``new_cache``) rebuilds a rotary table on the model (131,072 B), as models that
    size their tables to the longest sequence do: the table is the model's, held with or without a cache."""

    name = "rotary_table_decoder"
    caches = {"RotaryTableCache": {}}

    def new_cache(self, model, batch_size, max_len):
        model.rope_table = torch.randn(512, 64)  # 512 positions × 64 floats: a new table every new cache
        self.last_table = model.rope_table  # the adapter keeps it too (what the cache reaches through .adapter)
        return super().new_cache(model, batch_size, max_len)


def test_a_table_the_model_rebuilds_at_every_new_cache_is_not_the_caches_memory():
    """Before the model's own storages were excluded, ``memory_released`` counted the table of the last request
    (131,072 B > the 16,384 B slack: "memory grows with every request") and ``memory_decode`` counted the adapter's
    copy as the cache's."""
    results = kvconform.check_cache([], models=[RotaryTableDecoder()],
                                    checks=["check_memory_released", "check_memory_bytes"],
                                    cases=["memory_released", "memory_decode"])
    ran = {r.check: r for r in results if r.outcome != "skipped"}
    assert set(ran) == {"check_memory_released", "check_memory_bytes"}, [(r.check, r.message) for r in results]
    for r in ran.values():
        assert r.outcome == "passed", r.message
    assert ran["check_memory_released"].metrics["kept_bytes"] < 16384
    # the dict cache's keys and values, nothing of the table: 2 blocks × 2 heads × 8 × 4 B × 2 (K, V) per token
    decode = ran["check_memory_bytes"].metrics
    assert decode["bytes_held"] == decode["bytes_formula"] > 0


# ------------------------------------------------------------------------------------------ nothing measured
_HIDDEN: dict = {}


class HiddenStoreCache(PagePoolCache):
    """A page pool kept where no attribute of the cache leads (a module-level dict keyed by the cache's id): exact
    logits, and 0 bytes reachable from the cache object while it holds tokens."""

    @property
    def pool(self):
        return _HIDDEN.get(id(self))

    @pool.setter
    def pool(self, value):
        _HIDDEN[id(self)] = value


def test_a_cache_whose_bytes_cannot_be_seen_is_not_a_pass():
    try:
        result = _one(kvconform.check_cache(HiddenStoreCache, models=["llama"], **MEMORY))
    finally:
        _HIDDEN.clear()
    assert result.outcome == "failed", result.message
    assert result.metrics["blind"].startswith("0 bytes counted while the cache holds 12 tokens per row")
    assert "blind: 0 bytes counted" in result.message
    measured = result.metrics["measured"]
    assert (measured["bytes_held"], measured["tokens_held"]) == (0, 12)
    # the op interpreter's own count of the ops applied to the subject's cache (the reference's run is not in it)
    assert measured["ops_applied"] == {"prefill": 2, "chunk": 1, "decode": 2, "reset": 1}


class UndeclaredPagePool(PagePoolCache):
    """The same pool, its page size not declared (what a vLLM-style author writes without kvconform in mind)."""

    kvconform_page_size = None


def test_an_undeclared_pool_has_its_pages_inferred_from_its_growth():
    """The pool grows by 2 rows × 1 page of both layers (2 · 2,048 B = P · Σ token bytes, P = 4) at S = 13, 17, 21
    and not at the other decode steps: pages of 4 tokens, inferred, so S = 6 after the reset (2 pages a row) is
    within one page per row and layer above the formula."""
    result = _one(kvconform.check_cache(UndeclaredPagePool, models=["llama"], **MEMORY))
    assert result.outcome == "passed", result.message
    assert result.metrics["page_tokens"] == 4
    assert "pages of 4 tokens, inferred from growth at decode steps" in result.metrics["granularity"]
    assert "of the pool on the cache object" in result.metrics["granularity"]


def test_page_pool_reorders_keep_the_bytes_of_the_rows_and_a_fork_leak_is_caught():
    """By hand (one page = 2,048 B, formula 1,024 B per token held per row pair): S = 12, 14, 16, 18, 20 take 3, 4,
    4, 5, 5 pages a row; beam search's reorders (a row taken twice, a plain reorder) copy each new row's pages and
    free the old ones, so the bytes do not move at a reorder. ``ForkLeakPagePoolCache`` keeps the old pages at every
    reorder: 73,728 B (36 pages) at the end against 20,480 B."""
    beam = dict(checks=["check_memory_bytes"], cases=["memory_beam"])
    result = _one(kvconform.check_cache(PagePoolCache, models=["llama"], **beam))
    assert result.outcome == "passed", result.message
    assert [row[1:] for row in result.metrics["per_op"]] == [
        [12, 12288, 12288], [14, 16384, 14336], [14, 16384, 14336], [16, 16384, 16384], [16, 16384, 16384],
        [18, 20480, 18432], [18, 20480, 18432], [20, 20480, 20480]]
    from kvconform.testing.page_pool import ForkLeakPagePoolCache

    leak = _one(kvconform.check_cache(ForkLeakPagePoolCache, models=["llama"], **beam))
    assert leak.outcome == "failed" and "bytes grow at a reorder of the rows" in leak.message
    assert leak.metrics["per_op"][-1][1:] == [20, 73728, 20480]
