"""Paged / block caches and the memory family: a cache's allocation granularity (pages of P tokens), declared
(``CacheSpec.page_size``, ``kvconform_page_size``) or inferred from the decode steps at which its bytes grow, buys it
at most one page per row and layer above the formula; over-allocating paged caches still fail, with the cause."""

from pathlib import Path

import pytest
import torch  # noqa: F401 - before pytester snapshots sys.modules (see test_plugin.py)

import kvconform
from kvconform.subjects import CacheSpec, SpecError, as_cache_spec, resolve_cache_spec, validate_spec
from kvconform.testing.faulty_paged import NeverFreedPagesCache, PagePerTokenCache
from kvconform.testing.paged import PagedAttentionLayer, PagedCache

SHARED_PAGED = Path(__file__).resolve().parents[3] / "shared" / "inputs" / "real-caches" / "paged" / "paged_cache.py"
MEMORY = dict(checks=["check_memory_bytes"], cases=["memory_decode"])


def _with_pages(cache, pages_needed=None, page_size=None):
    for layer in cache.layers:
        if isinstance(layer, PagedAttentionLayer):
            if page_size is not None:
                layer.page_size = page_size
            if pages_needed is not None:
                layer.pages_needed = pages_needed.__get__(layer)
    return cache


def undeclared_pages_of_3(config):
    """PagedCache with pages of 3 tokens and no declaration: a factory function has no kvconform_page_size."""
    return _with_pages(PagedCache(config=config), page_size=3)


def undeclared_pages_of_8(config):
    return _with_pages(PagedCache(config=config), page_size=8)


def two_spare_pages(config):
    """Pages of 4, but always two pages ahead of need (more than the one spare page per row allowed)."""
    return _with_pages(PagedCache(config=config), pages_needed=lambda self, tokens: -(-tokens // 4) + 2)


def _one(results):
    (result,) = [r for r in results if r.outcome != "skipped"]
    return result


# ------------------------------------------------------------------------------------------------- declaring
def test_page_size_is_declared_by_attribute_or_field_and_validated(tmp_path):
    assert as_cache_spec(PagedCache).page_size == 4
    assert as_cache_spec(undeclared_pages_of_3).page_size is None

    def factory(config):
        return PagedCache(config=config)

    factory.kvconform_page_size = 16
    assert as_cache_spec(factory).page_size == 16
    assert resolve_cache_spec("kvconform.testing.paged:PagedCache").page_size == 4
    for bad in (0, -4, 2.5, "4", True):
        factory.kvconform_page_size = bad
        with pytest.raises(SpecError, match="kvconform_page_size must be a positive int"):
            as_cache_spec(factory)
    (tmp_path / "bad_pages.py").write_text("from kvconform.testing.paged import PagedCache\n\n"
                                           "class BadPages(PagedCache):\n    kvconform_page_size = 0\n")
    with pytest.raises(SpecError, match=r"bad_pages.py:BadPages.*kvconform_page_size must be a positive int "
                                        r"\(tokens per page\), got 0"):
        resolve_cache_spec(f"{tmp_path / 'bad_pages.py'}:BadPages")
    validate_spec(CacheSpec("Paged", PagedCache, page_size=8), "test")
    with pytest.raises(SpecError, match="Paged: page_size must be a positive int"):
        validate_spec(CacheSpec("Paged", PagedCache, page_size=0), "test")
    assert list(CacheSpec.__dataclass_fields__)[-4:] == ["page_size", "allocation", "supports", "refuses"]


# ------------------------------------------------------------------------------------------------- passing
def test_declared_paged_cache_passes_memory_with_its_granularity_named():
    result = _one(kvconform.check_cache(PagedCache, models=["llama", "gemma2"][:1], **MEMORY))
    assert result.outcome == "passed", result.message
    assert result.metrics["granularity"].startswith("pages of 4 tokens, declared")
    assert result.metrics["page_tokens"] == 4
    # and it holds more than the formula (so the page allowance is what lets it pass): 6 tokens in 2 pages
    assert any(held > formula for _, _, held, formula in result.metrics["per_op"])


@pytest.mark.parametrize("factory, page, grew_at", [(undeclared_pages_of_3, 3, "S=19, S=22, S=7"),
                                                    (undeclared_pages_of_8, 8, "S=17")])
def test_undeclared_paged_cache_passes_memory_with_inferred_granularity(factory, page, grew_at):
    result = _one(kvconform.check_cache(factory, models=["mistral"], **MEMORY))
    assert result.outcome == "passed", result.message
    assert result.metrics["page_tokens"] == page
    assert result.metrics["granularity"].startswith(
        f"pages of {page} tokens, inferred from growth at decode steps {grew_at} (+{page} tokens' bytes")


@pytest.mark.skipif(not SHARED_PAGED.is_file(), reason=f"{SHARED_PAGED} not present")
def test_shared_undeclared_paged_cache_passes_memory(run_kvconform, pytester):
    result = run_kvconform("--kvconform-cache", f"{SHARED_PAGED}:PagedCache", "--kvconform-subject", "PagedCache",
                           "--kvconform-model", "llama", "--kvconform-model", "t5", "-m", "kvconform_memory")
    # memory bytes on llama (memory_decode, memory_beam), memory released (llama), t5
    result.assert_outcomes(passed=4, skipped=3)


def test_builtin_caches_are_token_by_token():
    result = _one(kvconform.check_cache("kvconform.subjects:_dynamic", models=["llama"], **MEMORY))
    assert result.outcome == "passed" and result.metrics["page_tokens"] == 1
    assert result.metrics["granularity"].startswith("token by token")


# ------------------------------------------------------------------------------------------------- failing
@pytest.mark.parametrize("cache, fragments", [
    (PagePerTokenCache, ("(4.00× the formula)", "granularity of layer 0: pages of 4 tokens, declared",
                         "likely cause: a new page (4 tokens, 2048 B) is allocated for every token")),
    (NeverFreedPagesCache, ("[measured after prefill(6) after the reset]",
                            "granularity of layer 0: pages of 4 tokens, declared",
                            "likely cause: pages are not freed by reset()")),
    (two_spare_pages, ("granularity of layer 0: pages of 4 tokens, inferred from growth at decode steps S=17, S=21",
                       "+ one page per row (4 tokens: 2048 B)",
                       "likely cause: more than one spare page per row")),
])
def test_over_allocating_paged_caches_fail_memory_with_the_cause(cache, fragments):
    result = _one(kvconform.check_cache(cache, models=["llama"], **MEMORY))
    assert result.outcome == "failed"
    for fragment in fragments:
        assert fragment in result.message, (fragment, result.message)
    assert result.metrics["layer_granularity"].startswith("pages of 4 tokens")


CROP_CASE = """
[[case]]
id = "memory_crop_pages"
check = "check_memory_bytes"
ops = ["prefill 12", "decode 4", "crop 8", "decode 3"]
batch = 2
models = ["llama"]
description = "crop frees the pages past the new end"
"""


def test_pages_not_freed_by_crop_fail_a_memory_case_with_crop(run_kvconform, pytester):
    """The memory ops accept crop: NeverFreedPagesCache keeps 4 pages for 8 tokens after crop(-8) and fails with
    the cause; PagedCache frees them and passes."""
    pytester.makefile(".toml", crop_cases=CROP_CASE)
    result = run_kvconform("--kvconform-cases", "crop_cases.toml", "--kvconform-model", "llama",
                           "--kvconform-cache", "kvconform.testing.paged:PagedCache",
                           "--kvconform-cache", "kvconform.testing.faulty_paged:NeverFreedPagesCache",
                           "--kvconform-subject", "PagedCache", "--kvconform-subject", "NeverFreedPagesCache",
                           "-k", "memory_crop_pages")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "check_memory_bytes failed: NeverFreedPagesCache on llama" in out
    assert "[measured after crop(-8)]" in out
    assert "likely cause: pages are not freed by crop()" in out
