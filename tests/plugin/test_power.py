"""The power pass (``--kvconform-power``, issue 38 part 3): mutants of a subject made at its cache interface, run
again on the items that passed, and the power table they give — in the terminal, the JSON report's ``power`` section
and the HTML page. What is asserted is what kvconform measured (the JSON report), never one CPU's numbers."""

import json
import textwrap
from pathlib import Path

from kvconform.checks._power import BY_NAME, KILLED, SURVIVED, UNUSED
from kvconform.report import POWER_STATES

POOL = f"{Path(__file__).resolve().parents[1] / 'page_pool_cache.py'}:PagePoolCache"
"""A page pool written from scratch (``tests/page_pool_cache.py``): pool and free list on the cache object, block
tables per row and layer, copies for a row taken twice — a design kvconform does not bundle."""
# a slice of the plan with every op a mutant needs: decode (stale / dropped token), reorder, select, repeat, reset,
# crop, and a memory item (the leak)
SLICE = ("PagePoolCache and (reorder_padded or select_padded or repeat_padded or reset_reuse or crop_short "
         "or decode_explicit_positions or memory_decode)")


def _outcomes(report: dict) -> dict:
    return {r["nodeid"]: r["outcome"] for r in report["results"]}


def _cell_keys():
    return {"status", "ran", "killed", "errors", "killed_by", "blind_items"}


def test_a_custom_cache_gets_a_power_table_with_killed_cells_and_its_outcomes_unchanged(run_kvconform, pytester):
    """A correct page-pool cache written from scratch (``POOL``, a design kvconform does not bundle): with the
    default sampled pass every mutant its slice of the plan exercises is killed by the family meant to kill it; the
    items' outcomes are those of a run without the pass; the JSON ``power`` section has its documented shape and the
    HTML page its table; a run with ``--kvconform-power off`` has no ``power`` key and no mutant results."""
    common = ("--kvconform-model", "llama", "--kvconform-cache", POOL, "--kvconform-subject", "PagePoolCache",
              "-n", "0", "-k", SLICE)
    off = run_kvconform(*common, "--kvconform-power", "off", "--kvconform-json", "off.json")
    assert off.ret == 0, off.stdout.str()
    on = run_kvconform(*common, "--kvconform-json", "on.json", "--kvconform-html", "on.html")
    assert on.ret == 0, on.stdout.str()
    report_off = json.loads((pytester.path / "off.json").read_text())
    report = json.loads((pytester.path / "on.json").read_text())
    assert "power" not in report_off
    assert not any("power" in r["metrics"] for r in report_off["results"])
    assert _outcomes(report) == _outcomes(report_off) and set(_outcomes(report).values()) == {"passed"}
    assert report["environment"]["power"] == "sampled"

    power = report["power"]
    assert set(power) == {"mode", "mutants", "subjects"} and power["mode"] == "sampled"
    assert set(power["mutants"]) == set(BY_NAME)
    assert all(set(m) == {"what", "families"} and m["families"] for m in power["mutants"].values())
    table = power["subjects"]["PagePoolCache"]
    records = {r["nodeid"]: r for r in report["results"]}
    for family, cells in table.items():
        for name, cell in cells.items():
            assert set(cell) == _cell_keys() and cell["status"] in POWER_STATES, (family, name, cell)
            assert family in power["mutants"][name]["families"]
            if cell["status"] == "killed":  # the item named killed it, and passed itself
                killer = records[cell["killed_by"]]
                assert killer["outcome"] == "passed" and killer["metrics"]["power"][name] == KILLED
                assert killer["family"] == family
            for nodeid in cell["blind_items"]:
                assert records[nodeid]["metrics"]["power"][name] == SURVIVED
    expected_kills = {("logits", "stale_token"), ("logits", "dropped_token"), ("batch", "reorder_ignored"),
                      ("batch", "select_ignored"), ("batch", "repeat_ignored"), ("lifecycle", "reset_noop"),
                      ("crop", "crop_noop")}
    statuses = {(f, n): c["status"] for f, cells in table.items() for n, c in cells.items()}
    assert {k for k in expected_kills if statuses.get(k) == "killed"} == expected_kills, statuses
    assert "power_s" in records[table["batch"]["reorder_ignored"]["killed_by"]]["metrics"]

    out = on.stdout.str()
    assert "PagePoolCache: families × mutants" in out and "kvconform power" in out
    html = (pytester.path / "on.html").read_text()
    assert 'id="kv-power"' in html and 'data-subject="PagePoolCache"' in html


def test_a_case_that_cannot_see_a_mutant_is_a_blind_cell(run_kvconform, pytester):
    """A case whose two reorders roll two rows back to where they were cannot see a ``reorder_cache`` that ignores
    its indices: under ``--kvconform-power full`` the batch × reorder_ignored cell of the (correct) subject is blind,
    named in the terminal with its item, while the item itself passes and the exit code stays 0."""
    pytester.path.joinpath("blind.toml").write_text(textwrap.dedent("""
        [[case]]
        id = "reorder_twice"
        check = "check_reorder_then_decode"
        batch = 2
        ops = ["prefill 8", "reorder", "reorder", "decode 2"]
        description = "two rolls of two rows: the identity, so a reorder that ignores its indices cannot show"
    """))
    result = run_kvconform("--kvconform-model", "llama", "--kvconform-cache", POOL, "--kvconform-subject",
                           "PagePoolCache", "--kvconform-cases", "blind.toml", "--kvconform-power", "full", "-n", "0",
                           "-k", "PagePoolCache and reorder_twice", "--kvconform-json", "r.json")
    assert result.ret == 0, result.stdout.str()
    report = json.loads((pytester.path / "r.json").read_text())
    (record,) = report["results"]
    assert record["outcome"] == "passed"
    assert record["metrics"]["power"]["reorder_ignored"] == SURVIVED
    assert record["metrics"]["power"]["stale_token"] == KILLED  # the same item does see a wrong token
    cell = report["power"]["subjects"]["PagePoolCache"]["batch"]["reorder_ignored"]
    assert cell["status"] == "blind" and cell["blind_items"] == [record["nodeid"]]
    assert report["power"]["mode"] == "full"
    out = result.stdout.str()
    assert "PagePoolCache × batch × reorder_ignored" in out and "reorder_twice" in out
    assert "what to do: " in out and "add one (--kvconform-cases" in out


def test_a_mistyped_power_mode_is_a_usage_error(run_kvconform):
    """``--kvconform-power`` takes off, sampled or full; anything else is exit 4 naming the value and the choices."""
    result = run_kvconform("--kvconform-model", "llama", "--kvconform-power", "fast", "-n", "0")
    assert result.ret == 4
    err = result.stderr.str()
    assert "--kvconform-power 'fast'" in err and "off, sampled, full" in err


def test_built_in_subjects_run_no_mutant_unless_full(run_kvconform, pytester):
    """kvconform's own subjects get no power pass by default (the default run's time and outcomes stay theirs);
    ``--kvconform-power full`` runs it on them too, without changing the item's outcome."""
    args = ("--kvconform-model", "llama", "--kvconform-subject", "DynamicCache", "-n", "0", "-k",
            "DynamicCache and decode_explicit_positions")
    default = run_kvconform(*args, "--kvconform-json", "d.json")
    full = run_kvconform(*args, "--kvconform-power", "full", "--kvconform-json", "f.json")
    assert default.ret == full.ret == 0, default.stdout.str() + full.stdout.str()
    (plain,) = json.loads((pytester.path / "d.json").read_text())["results"]
    report = json.loads((pytester.path / "f.json").read_text())
    (powered,) = report["results"]
    assert "power" not in plain["metrics"] and plain["outcome"] == powered["outcome"] == "passed"
    assert powered["metrics"]["power"] == {"stale_token": KILLED, "dropped_token": KILLED}
    assert report["power"]["subjects"]["DynamicCache"]["logits"]["stale_token"]["status"] == "killed"
    assert "kvconform power" not in default.stdout.str()


def test_a_model_adapters_select_crop_reset_and_cache_object_are_mutated(run_kvconform, pytester):
    """A model written from scratch (the worked example adapter): its ``select`` (reorder, select, repeat), ``crop``,
    ``reset`` and cache object (a decode token dropped from its state) get mutants, each killed by the family meant
    to kill it; ``update()``'s stale token has no adapter form (not in its table)."""
    result = run_kvconform("--kvconform-model", "kvconform.examples.tiny_decoder:TinyDecoder", "-n", "0", "-k",
                           "reorder_padded or select_padded or repeat_padded or reset_reuse or crop_short",
                           "--kvconform-json", "r.json")
    assert result.ret == 0, result.stdout.str()
    report = json.loads((pytester.path / "r.json").read_text())
    (subject,) = report["power"]["subjects"]
    table = report["power"]["subjects"][subject]
    statuses = {(f, n): c["status"] for f, cells in table.items() for n, c in cells.items()}
    for cell in (("batch", "reorder_ignored"), ("batch", "select_ignored"), ("batch", "repeat_ignored"),
                 ("lifecycle", "reset_noop"), ("crop", "crop_noop"), ("batch", "dropped_token")):
        assert statuses.get(cell) == "killed", (cell, statuses)
    assert not any(n == "stale_token" for _, n in statuses)


def test_merged_shards_give_the_power_table_of_the_whole_run():
    """``kvconform-merge`` rebuilds the ``power`` section from the shards' records: a mutant one shard's item let
    through and the other's killed is killed for the run; one only passed is blind, naming its item; a family expected
    to kill a mutant the subject ran but none of whose items ran it is n/a."""
    from kvconform.merge import merge_reports

    def record(case, family, power):
        nodeid = f"test_conformance.py::test_conformance[Pool-llama-{family}_check-{case}]"
        return {"nodeid": nodeid, "subject": "Pool", "model": "llama", "check": f"check_{family}", "family": family,
                "case": case, "dtype": "float32", "batch": 2, "outcome": "passed", "message": "",
                "metrics": {"power": power}}

    def shard(i, records):
        return (f"s{i}.json", {"schema": 1, "complete": True, "planned": 1, "finished": 1, "incomplete": None,
                               "environment": {"shard": f"{i}/2", "subjects": ["Pool"], "models": ["llama"],
                                               "power": "sampled"},
                               "results": records})

    merged = merge_reports([shard(1, [record("a", "batch", {"reorder_ignored": SURVIVED}),
                                      record("c", "generate", {}),
                                      record("d", "prefix", {"select_ignored": UNUSED})]),
                            shard(2, [record("b", "batch", {"reorder_ignored": KILLED, "select_ignored": SURVIVED})])])
    cells = merged["power"]["subjects"]["Pool"]["batch"]
    assert merged["power"]["mode"] == "sampled"
    assert cells["reorder_ignored"]["status"] == "killed" and cells["reorder_ignored"]["ran"] == 2
    assert cells["reorder_ignored"]["killed_by"].endswith("[Pool-llama-batch_check-b]")
    assert cells["select_ignored"]["status"] == "blind"
    assert cells["select_ignored"]["blind_items"] == [record("b", "batch", {})["nodeid"]]
    # reorder_ignored is expected of the generate family too: a cell there, n/a (no item of it ran the mutant)
    assert merged["power"]["subjects"]["Pool"]["generate"]["reorder_ignored"]["status"] == "n/a"
    assert merged["power"]["subjects"]["Pool"]["generate"]["reorder_ignored"]["why"] == "not planned"
    # an item of the prefix family ran without the op select_ignored changes: n/a, not exercised
    assert merged["power"]["subjects"]["Pool"]["prefix"]["select_ignored"]["why"] == "not exercised"


def test_a_mutant_that_makes_kvconforms_own_code_raise_is_no_kill(run_kvconform, pytester):
    """kvconform's ``ReferenceCache`` whose ``reset()`` does nothing keeps two rows, and its own code then raises on
    the next batch of four (``reference.py``, concatenating 2 rows with 4): a raise inside kvconform's own code
    (``KVConformInternalError``), so the mutant's result is ``error`` (no verdict), never ``killed``; the cell is
    not killed by it, and the item and the exit code are unchanged."""
    result = run_kvconform("--kvconform-model", "llama", "--kvconform-subject", "ReferenceCache", "-n", "0",
                           "--kvconform-power", "full", "-k", "ReferenceCache and reset_larger_batch",
                           "--kvconform-json", "r.json")
    assert result.ret == 0, result.stdout.str()
    report = json.loads((pytester.path / "r.json").read_text())
    (record,) = report["results"]
    assert record["outcome"] == "passed" and record["metrics"]["power"]["reset_noop"] == "error"
    cell = report["power"]["subjects"]["ReferenceCache"]["lifecycle"]["reset_noop"]
    assert cell["status"] == "n/a" and cell["errors"] == 1 and cell["killed"] == 0 and cell["why"] == "no verdict"
    assert "n/a (no verdict)" in result.stdout.str()
