"""The conformance page (``--kvconform-html``, ``kvconform-merge --html``), from one real run, read in a real
browser: headless Chromium (Debian's ``chromium``) driven by playwright. The page renders without loading anything,
its totals and every matrix cell equal what the JSON report of the same run says, a click on a failed cell shows
that item's message and reproduce line, and the filters narrow the items. The browser tests skip where chromium or
playwright is absent (``.ci/run`` installs both)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter

import pytest

from kvconform import html_report, merge, report

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]

FAULTS = textwrap.dedent("""
    [[fault]]
    id = "pretend-fault"
    transformers = ">=5"
    subject = "DynamicCache"
    model = "llama"
    check = "check_prefill_then_decode"
    case = "decode_explicit_positions"
    reason = "an entry for an item that conforms: XPASS"

    [[fault]]
    id = "typo-in-case"
    transformers = ">=5"
    model = "llama"
    case = "decode_explicit_position"
    reason = "a case id that does not exist: stale"

    [[fault]]
    id = "markup-in-reason"
    transformers = ">=5"
    subject = "HiddenWindowCache"
    model = "gpt2"
    check = "check_chunked_continuation"
    reason = "a reason with <b>markup</b> & <script>window.kvInjected = 1</script>"
""")
"""A known-faults file giving the run an XPASS, a stale entry and an xfail whose reason is markup."""

MARKUP = "a reason with <b>markup</b> & <script>window.kvInjected = 1</script>"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One real run (10 s of CPU): llama and gpt2; DynamicCache (passes), StaticCache (known faults
    xfail), DynamicCache_offloaded (skips: no CUDA) and the bundled faulty HiddenWindowCache (fails); the logits and
    lifecycle families and the float64 case padded_row_alone; the known faults of ``FAULTS``. Returns the folder,
    the JSON report and the run's output."""
    folder = tmp_path_factory.mktemp("html_run")
    (folder / "faults.toml").write_text(FAULTS)
    args = [sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
            "--kvconform-model", "llama", "--kvconform-model", "gpt2",
            "--kvconform-cache", "kvconform.testing.faulty_logits:HiddenWindowCache",
            *(a for s in ("HiddenWindowCache", "DynamicCache", "StaticCache", "DynamicCache_offloaded")
              for a in ("--kvconform-subject", s)),
            "--kvconform-known-faults", "faults.toml",
            "-k", "kvconform_logits or kvconform_lifecycle or padded_row_alone",
            "--kvconform-json", "report.json", "--kvconform-html", "report.html"]
    # in one process (KVCONFORM_WORKERS=0): 10 s of CPU instead of 23 s with two workers, which each import torch
    # and build both models (27 s against 64 s wall at a load average of 8 on 2 cores); the page is written from the
    # run's digest either way (under xdist the controller's is the workers' digest.json)
    env = {**os.environ, "KVCONFORM_WORKERS": "0"}
    proc = subprocess.run(args, cwd=folder, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]  # HiddenWindowCache fails
    data = json.loads((folder / "report.json").read_text())
    return folder, data, proc.stdout


def _counts(data) -> Counter:
    return Counter(r["outcome"] for r in data["results"])


def test_the_run_has_every_outcome_the_page_must_show(run):
    _, data, _ = run
    counts = _counts(data)
    assert {"passed", "failed", "skipped", "xfailed", "xpassed"} <= set(counts), counts
    assert any(r["message"] == MARKUP for r in data["results"] if r["outcome"] == "xfailed")


def test_the_page_is_self_contained_and_escapes_every_text(run):
    folder, data, _ = run
    page = (folder / "report.html").read_text()
    lowered = page.lower()
    for reference in ("<link", " src=", "href=", "@import", "url(", "http://", "https://"):
        assert reference not in lowered, reference  # nothing is loaded from anywhere
    assert MARKUP not in page  # only escaped: in the header as entities, in the data block as \\u escapes
    assert html_report._e(MARKUP) in page
    block = page.split('<script type="application/json" id="kv-data">')[1].split("</script>")[0]
    assert "<" not in block and "&" not in block
    payload = json.loads(block)
    assert len(payload["items"]) == len(data["results"])
    assert MARKUP in payload["texts"]
    # the header says what the terminal's known-fault summary says (the run's digest names the entries)
    assert "stale: &#x27;typo-in-case&#x27;" in page and "XPASS: &#x27;pretend-fault&#x27;" in page
    assert "<b>markup-in-reason</b>" in page  # the xfailed items grouped under their entry


def test_dtypes_come_from_the_cases(run):
    _, data, _ = run
    dtypes = html_report.case_dtypes()
    assert dtypes["padded_row_alone"] == "float64" and dtypes["chunk2"] == "float32"
    payload = html_report.page_data(data)
    by_case = {payload["cases"][it[4]]: payload["dtypes"][it[5]] for it in payload["items"]}
    assert by_case["padded_row_alone"] == "float64" and {"float32", "float64"} <= set(by_case.values())
    assert all(by_case[case] == dtypes[case] for case in by_case if case in dtypes)  # bf16/fp16 cases too
    # a record's own dtype wins, and a case no file names gets none
    record = {**data["results"][0], "dtype": "bfloat16"}
    other = {**data["results"][1], "case": "a_case_of_my_own", "nodeid": data["results"][1]["nodeid"] + "x"}
    other.pop("dtype", None)  # a record of an older report: no dtype of its own
    payload = html_report.page_data({**data, "results": [record, other]})
    assert sorted(payload["dtypes"]) == sorted(["bfloat16", html_report.NO_DTYPE])


# ------------------------------------------------------------------------------------------------ in a browser
@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (Debian's package) under playwright, with a fresh profile; skipped where either is
    missing."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("chromium is not installed (apt-get install chromium chromium-driver; .ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is in the dev extra: pip install -e .[dev]")
    with sync_api.sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        context = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                       args=BROWSER_ARGS, viewport={"width": 1400, "height": 900})
        yield context
        context.close()


def _open(browser, path):
    """The page at ``path``, loaded; returns ``(page, requests, errors)``: every URL the page asked for and every
    script error and console error."""
    page = browser.new_page()
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready]", timeout=20_000)
    return page, requests, errors


def _grid(page, table_id) -> dict:
    """``{(row, column): cell text}`` of a rendered grid, empty cells as "n/a" (the terminal's text)."""
    cells = page.eval_on_selector_all(
        f"#{table_id} td.cell", "tds => tds.map(td => [td.dataset.row, td.dataset.col, td.textContent])")
    return {(r, c): (t or "n/a") for r, c, t in cells}


def _totals(page) -> dict:
    shown = page.eval_on_selector_all("#kv-totals button", "bs => bs.map(b => [b.dataset.outcome, +b.dataset.count])")
    return dict(shown)


def _expected_grid(results, rows_key, cols_key, cols):
    return {(name, col): text for name, cells, _ in report.matrix(results, rows_key, cols, cols_key)
            for col, text in zip(cols, cells)}


def _check_page_counts(page, data):
    results = {r["nodeid"]: r for r in data["results"]}
    assert _totals(page) == dict(_counts(data))
    assert page.get_attribute("#kv-count", "data-count") == str(len(results))
    families = report._families(results)
    subjects = report._ordered((r["subject"] for r in results.values()), data["environment"]["subjects"])
    assert _grid(page, "g-families") == _expected_grid(results, "subject", "family", families)
    assert _grid(page, "g-models") == _expected_grid(results, "model", "subject", subjects)
    rows = page.eval_on_selector_all("#g-models tbody th", "ths => ths.map(th => th.dataset.row)")
    assert rows == report._ordered((r["model"] for r in results.values()), data["environment"]["models"])


def test_the_page_renders_loads_nothing_and_its_counts_equal_the_json_report(browser, run):
    folder, data, _ = run
    page, requests, errors = _open(browser, folder / "report.html")
    assert errors == []
    assert requests == [(folder / "report.html").as_uri()]  # the page itself, nothing else
    _check_page_counts(page, data)
    assert page.evaluate("window.kvInjected") is None  # the reason's <script> is text, never run
    assert MARKUP in page.inner_text("#kv-known")
    assert "typo-in-case" in page.inner_text("#kv-known")
    bad = [r for r in data["results"] if r["outcome"] in ("failed", "error")]
    assert page.inner_text("#kv-failures-title") == f"failures ({len(bad)})"
    page.close()


def test_a_click_on_a_failed_cell_shows_its_messages_and_reproduce_lines(browser, run):
    folder, data, _ = run
    page, _, errors = _open(browser, folder / "report.html")
    failed = [r for r in data["results"] if r["outcome"] == "failed" and r["model"] == "gpt2"]
    assert failed and {r["subject"] for r in failed} == {"HiddenWindowCache"}
    assert page.is_hidden("#kv-panel")
    cell = page.locator('#g-models td[data-row="gpt2"][data-col="HiddenWindowCache"]')
    assert "c-fail" in cell.get_attribute("class")
    cell.click()
    assert page.is_visible("#kv-panel")
    in_cell = [r for r in data["results"] if r["model"] == "gpt2" and r["subject"] == "HiddenWindowCache"]
    assert page.locator("#kv-panel-body .item").count() == len(in_cell)
    shown = page.eval_on_selector_all("#kv-panel-body details[open] pre.msg", "ps => ps.map(p => p.textContent)")

    def without_reproduce(message):
        return "\n".join(x for x in message.split("\n") if not x.strip().startswith("reproduce: "))

    # open: the message is the click's answer, its reproduce line shown once, in the copy box
    assert sorted(shown) == sorted(without_reproduce(r["message"]) for r in failed)
    for r in failed:
        box = page.locator(f'#kv-panel-body .item[data-id="{html_report._item_id(r["nodeid"])}"]')
        assert box.locator("pre.msg").is_visible()
        line = next(x.strip() for x in r["message"].splitlines() if x.strip().startswith("reproduce: "))
        assert box.locator(".repro code").inner_text() == line.removeprefix("reproduce: ")
        assert box.inner_text().count(line.removeprefix("reproduce: ")) == 1
        # the item's tooltip carries its id and the duration the JSON report measured
        seconds = r["duration_s"]
        title = box.locator("summary").get_attribute("title")
        assert title.startswith(html_report._item_id(r["nodeid"]) + " (") and title.endswith(("ms)", "s)")), title
        assert seconds > 0
    # the xfailed item of that cell shows its reason, as text, one click away
    xfailed = next(r for r in in_cell if r["outcome"] == "xfailed")
    box = page.locator(f'#kv-panel-body .item[data-id="{html_report._item_id(xfailed["nodeid"])}"]')
    box.locator("summary").click()
    assert box.locator("pre.msg").inner_text() == MARKUP
    assert "markup-in-reason" in box.locator("summary").inner_text()
    page.keyboard.press("Escape")
    assert page.is_hidden("#kv-panel")
    # a failure of the failure list is one click away too
    first = page.locator("#kv-failures .item").first
    first.locator("summary").click()
    assert first.locator("pre.msg").is_visible()
    assert errors == []
    page.close()


def test_filters_narrow_the_items_and_the_grids(browser, run):
    folder, data, _ = run
    results = data["results"]
    page, _, errors = _open(browser, folder / "report.html")

    def shown():
        return int(page.get_attribute("#kv-count", "data-count"))

    page.select_option("#f-subject", label="HiddenWindowCache")
    assert shown() == sum(r["subject"] == "HiddenWindowCache" for r in results)
    assert page.eval_on_selector_all("#g-models thead th.col", "ths => ths.map(t => t.dataset.col)") == [
        "HiddenWindowCache"]
    page.select_option("#f-outcome", value="bad")
    assert shown() == sum(r["subject"] == "HiddenWindowCache" and r["outcome"] in ("failed", "error") for r in results)
    page.click("#f-reset")
    assert shown() == len(results)
    page.fill("#f-model", "gpt2")
    assert shown() == sum(r["model"] == "gpt2" for r in results)
    assert page.eval_on_selector_all("#g-models tbody th", "ths => ths.map(t => t.dataset.row)") == ["gpt2"]
    page.fill("#f-model", "")
    page.select_option("#f-family", label="lifecycle")
    assert shown() == sum(r["family"] == "lifecycle" for r in results)
    page.click("#f-reset")
    page.select_option("#f-dtype", label="float64")
    assert shown() == sum(r["case"] == "padded_row_alone" for r in results) > 0
    page.click("#f-reset")
    page.click('#kv-totals button[data-outcome="xfailed"]')  # a total filters by its outcome
    assert shown() == sum(r["outcome"] == "xfailed" for r in results)
    assert page.input_value("#f-outcome") == "xfailed"
    assert errors == []
    page.close()


def test_kvconform_merge_writes_the_merged_page(browser, run, tmp_path, capsys):
    """``kvconform-merge --html``: the page of the merged report (here of one unsharded report, which merges to
    itself) has the same counts; without the run's digest it lists the XPASS items and says where stale entries are
    listed."""
    folder, data, _ = run
    out = tmp_path / "merged.html"
    assert merge.main(["--html", str(out), str(folder / "report.json")]) == 1  # a failure: exit 1
    capsys.readouterr()
    page, requests, errors = _open(browser, out)
    assert errors == [] and requests == [out.as_uri()]
    _check_page_counts(page, data)
    known = page.inner_text("#kv-known")
    assert f"XPASS: {_counts(data)['xpassed']} item(s) expected to fail passed" in known
    assert "stale entries: not recorded in the JSON report" in known
    assert "merged from 1 report(s)" in page.inner_text("#kv-merged")
    page.close()


def test_a_page_path_that_cannot_be_written_is_refused_before_anything_runs(tmp_path, capsys):
    (tmp_path / "r.json").write_text(json.dumps({"schema": 1, "environment": {}, "results": []}))
    assert merge.main(["--html", str(tmp_path / "no_such_folder" / "p.html"), str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "--html" in err and "does not exist" in err
    proc = subprocess.run([sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider",
                           "--kvconform-html", "no_such_folder/p.html"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "--kvconform-html 'no_such_folder/p.html': folder" in proc.stderr


def test_a_report_cut_short_says_so_at_the_top():
    """A report that says it is incomplete (``complete: false``, with its counts) gets a banner naming them; a
    complete one none."""
    base = {"schema": 1, "environment": {}, "results": []}
    page = html_report.render({**base, "complete": False, "planned": 10, "finished": 3})
    assert 'id="kv-incomplete"' in page and "planned 10, finished 3" in page
    assert 'id="kv-incomplete"' not in html_report.render({**base, "complete": True})
    assert 'id="kv-incomplete"' not in html_report.render(base)
