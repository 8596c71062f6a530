"""The one owner of per-run memo state: tables that modules fill while a run goes (what a model class wants as a
mask, the reference cache's shapes and bytes per case, what a subject declares per model, the features of a zoo
family). ``MEMO.clear()`` empties them all; the session calls it when it is built, so that a second run in the same
process (``check_cache``, a test starting a run) never reads what the previous run measured.
"""

from __future__ import annotations


class RunMemo:
    """Named memo tables (plain dicts) with one ``clear``.

    A module takes its table once, at import (``_SHAPES = MEMO.table("memory.shapes")``), and uses it as a dict;
    ``clear`` empties every table in place, so those module-level names stay valid.
    """

    def __init__(self):
        self._tables: dict[str, dict] = {}

    def table(self, name: str) -> dict:
        """The table called ``name`` (``"<module>.<what>"``), created empty on first use."""
        return self._tables.setdefault(name, {})

    def names(self) -> list[str]:
        """The tables' names, in the order they were created."""
        return list(self._tables)

    def clear(self) -> None:
        """Empty every table."""
        for table in self._tables.values():
            table.clear()


MEMO = RunMemo()
"""The process's memo tables."""
