"""The example matrices and default-run counts of README.md and docs/ are generated from a real run
(ci/readme_examples.py); these tests hold the committed blocks to the current code, so that they cannot go stale, and
every copy of a block (README.md and the docs pages) to README.md's. The real run's side is in
tests/plugin/test_plugin.py
(test_empty_folder_run_with_json_and_known_fault_xfail compares its own output with them)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
CELL = re.compile(r"^(\d+/\d+( x\d+)?( F\d+)?|skip \d+|n/a|\.\.\.)$")


def readme_examples():
    spec = importlib.util.spec_from_file_location("readme_examples", ROOT / "ci" / "readme_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_tables() -> list[tuple[str, list[str], list[list[str]]]]:
    """``[(title, header cells, row cells)]`` of the README's generated matrix block."""
    block = readme_examples().blocks((ROOT / "README.md").read_text())["matrix"]
    tables, current = [], None
    for line in block.strip("`\n").splitlines():
        if line.endswith(":"):
            current = (line, None, [])
            tables.append(current)
        elif current is not None and line and line != "...":
            cells = re.split(r"\s{2,}", line.strip())
            if current[1] is None:
                tables[-1] = current = (current[0], cells, current[2])
            else:
                current[2].append(cells)
    return tables


def test_readme_matrix_block_has_the_current_families_subjects_models_and_cell_grammar():
    from kvconform.checks import FAMILIES
    from kvconform.subjects import builtin_subjects
    from kvconform.zoo import ZOO_NAMES as ZOO

    (t1, h1, rows1), (t2, h2, rows2) = readme_tables()
    assert t1 == "subjects × check families (passed/ran, xN = known faults xfailed, FN = failed):"
    assert t2 == "models × subjects:"
    families = [f for f in h1[1:] if f != "..."]
    assert families == [f for f in FAMILIES if f in families], h1  # the matrix's column order
    assert h1[1:6] == list(FAMILIES[:5]) and h1[-2:] == list(FAMILIES[-2:])
    names = {s.name for s in builtin_subjects()}
    assert rows1 and all(r[0] in names for r in rows1), rows1
    assert all(c in names for c in h2[1:] if c != "..."), h2
    assert rows2 and all(r[0] in ZOO for r in rows2), rows2
    for row in rows1 + rows2:
        assert all(CELL.match(c) for c in row[1:]), row


def test_readme_counts_sentence_is_the_generators_and_adds_up():
    text = readme_examples().blocks((ROOT / "README.md").read_text())["counts"]
    m = re.fullmatch(r"about (\d+) s wall on 2 CPU cores for ([\d,]+) items: ([\d,]+) pass, ([\d,]+) known upstream "
                     r"faults xfail, ([\d,]+) fail, ([\d,]+) skip with their reasons \(([\d,]+) ran\)", text)
    assert m, text
    total, passed, xfailed, failed, skipped, ran = (int(g.replace(",", "")) for g in m.groups()[1:])
    assert total == passed + xfailed + failed + skipped and ran == passed + xfailed + failed


def test_the_generator_renders_a_report_into_the_readme_structure():
    """ci/readme_examples.py on a small report: the same titles and cell grammar the README test expects."""
    mod = readme_examples()
    results = [{"nodeid": f"n{i}", "subject": s, "model": m, "check": "c", "family": f, "case": "k", "outcome": o,
                "message": "", "metrics": {}}
               for i, (s, m, f, o) in enumerate([("ReferenceCache", "llama", "logits", "passed"),
                                                 ("DynamicCache", "llama", "logits", "xfailed"),
                                                 ("StaticCache", "mistral", "speed", "skipped")])]
    rendered = mod.render(results, wall=31)
    assert rendered["counts"] == ("about 30 s wall on 2 CPU cores for 3 items: 1 pass, 1 known upstream faults "
                                  "xfail, 0 fail, 1 skip with their reasons (2 ran)")
    text = "a\n<!-- readme_examples:matrix -->\nold\n<!-- /readme_examples:matrix -->\nb"
    new = mod.replace(text, rendered)
    assert mod.blocks(new)["matrix"] == rendered["matrix"]
    assert "ReferenceCache  1/1" in rendered["matrix"] and "DynamicCache    0/1 x1" in rendered["matrix"]


def test_every_copy_of_a_generated_block_is_the_readmes_and_the_generator_rewrites_each():
    """A block may sit in README.md and in docs pages (docs/index.md repeats the quick start): each copy equals
    README.md's, and ``--write`` reaches every file that holds one (``files()``)."""
    mod = readme_examples()
    readme = mod.blocks((ROOT / "README.md").read_text())
    assert set(readme) == {"matrix", "counts"}, sorted(readme)
    copies = {path: mod.blocks(path.read_text()) for path in mod.files()}
    assert ROOT / "docs" / "index.md" in copies and copies[ROOT / "docs" / "index.md"], "docs/index.md has no block"
    for path, found in copies.items():
        for name, content in found.items():
            assert content == readme[name], f"{path.relative_to(ROOT)}: block {name} differs from README.md's"
    holders = [p for p, found in copies.items() if found]
    assert ROOT / "README.md" in holders and len(holders) >= 2, holders


def test_the_generator_writes_and_checks_every_file_that_holds_a_block(tmp_path):
    """``--write`` rewrites the blocks in README.md and in each docs page that holds one; ``--check`` exits 1 before
    and 0 after (run on copies of the files, with a small report)."""
    import json
    import shutil
    import subprocess
    import sys

    (tmp_path / "ci").mkdir()
    shutil.copy(ROOT / "ci" / "readme_examples.py", tmp_path / "ci")
    shutil.copy(ROOT / "README.md", tmp_path)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    results = [{"nodeid": f"n{i}", "subject": s, "model": "llama", "check": "c", "family": "logits", "case": "k",
                "outcome": o, "message": "", "metrics": {}}
               for i, (s, o) in enumerate([("ReferenceCache", "passed"), ("DynamicCache", "failed")])]
    (tmp_path / "report.json").write_text(json.dumps({"schema": 1, "results": results}))

    def run(*args):
        script, report = tmp_path / "ci" / "readme_examples.py", tmp_path / "report.json"
        return subprocess.run([sys.executable, str(script), str(report), "--wall", "12", *args],
                              capture_output=True, text=True)

    before = run("--check")
    assert before.returncode == 1 and "README.md" in before.stderr and "docs/index.md" in before.stderr, before.stderr
    assert run("--write").returncode == 0
    assert run("--check").returncode == 0
    mod = readme_examples()
    sentence = "about 10 s wall on 2 CPU cores for 2 items: 1 pass, 0 known upstream faults xfail, 1 fail, 0 skip"
    for page in ("README.md", "docs/index.md"):
        assert mod.blocks((tmp_path / page).read_text())["counts"].startswith(sentence), page
    assert "DynamicCache    0/1 F1" in mod.blocks((tmp_path / "docs" / "reading-results.md").read_text())["matrix"]
