"""A copy-on-write fault in ``batch_repeat_interleave`` is named as such (issue 43): a page pool whose repeat lets
the copies of a row share its pages (right while they are fed the same token, wrong once they write different ones)
gets a cause measured by a decode that feeds every copy one token — not "repeat_interleave, not tile", which stays
the cause of a cache that tiles the rows (``RepeatTilesCache``); the correct pool passes."""

from kvconform.api import check_cache
from kvconform.testing.faulty_semantics import RepeatTilesCache
from kvconform.testing.page_pool import PagePoolCache


class SharedRepeatPool(PagePoolCache):
    """The package's page pool, its row surgery written without copy-on-write: a row taken twice shares its pages."""

    def _map_rows(self, rows):
        if not self.block_tables or self.pool is None:
            return
        old = self.block_tables
        self.free = sorted(set(self.free) | {p for i, t in enumerate(old) if i not in set(rows) for p in t})
        self.block_tables = [list(old[r]) for r in rows]  # BUG: the copies of a row share its pages
        self._release([])


def _repeat(cls):
    (result,) = check_cache(cls, models=["llama"], cases=["repeat_padded"])
    return result


def test_shared_pages_after_repeat_are_called_copy_on_write_not_tiling():
    result = _repeat(SharedRepeatPool)
    assert result.outcome == "failed", result
    assert "sharing storage" in result.message and "without copy-on-write" in result.message, result.message
    assert "not tile" not in result.message, result.message


def test_tiling_keeps_its_cause_and_the_correct_pool_passes():
    tiles = _repeat(RepeatTilesCache)
    assert tiles.outcome == "failed" and "repeat_interleave, not tile" in tiles.message, tiles.message
    assert _repeat(PagePoolCache).outcome == "passed"
