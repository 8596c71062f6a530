"""Runs larger than one machine: ``--kvconform-shard I/N`` (a deterministic, balanced share of the items) and
``kvconform-merge`` (the shards' JSON reports back into one report, one matrix, one ``$GITHUB_STEP_SUMMARY``).

Splitting. pytest-xdist spreads a run over one machine's cores; CI jobs on several machines each run one shard.
Every shard collects the same items (the plan is deterministic: sorted, no addresses in ids) and keeps share ``I``
of them: the items are ordered by model name, then node id (never the run order, which pytest-randomly shuffles
with another seed in every process: measured, two 2-way shards then overlapped on 146 of 570 items), each is given
an estimated cost (``item_cost``: a skipped item almost nothing, a compile or speed item several times a logits
item) plus the cost of building its model once, and the ordered list is cut into ``N`` contiguous runs of equal
total cost. Contiguous by model, so a shard builds only about ``1/N`` of the models (model builds and oracles are
per process). Selection happens after ``-k`` / ``-m``, so ``-k`` keeps its meaning and the shards stay balanced.
With ``--kvconform-durations REPORT`` (an earlier run's JSON report, whose records carry ``duration_s``) the cut
balances the measured seconds instead; an item the report lacks is estimated from its static cost, scaled to seconds
by the items it has (``measured_costs``). Considered and not used: pytest-split (0.11, maintained) balances by
durations it needs stored from an earlier full run (``.test_durations``) and knows nothing of model builds;
pytest-shard (0.1.2, 2020) hashes node ids, which is deterministic but neither balanced nor grouped by model.

Merging. ``kvconform-merge --json OUT [--junitxml OUT.xml] IN.json...``: the union of the shards' results (schema 1;
an item reported by two shards must have the same outcome), the environment of the shards (which must agree on
kvconform, transformers, torch and device), a check that the shards given are all of ``1..N`` of one split, and the
run's state: complete only when every shard's report is (``merged_progress``). ``--junitxml`` writes the merged
report as JUnit XML (``junit.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvconform.outcomes import UsageError

MODEL_COST = 3.0
"""Estimated cost of building a model (and its float64 oracle) once in a process, relative to a logits item."""


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` → ``(I, N)`` with ``1 ≤ I ≤ N``.

    Raises:
        UsageError: anything else, naming the value and the form expected.
    """
    index, sep, count = str(text).partition("/")
    if not sep or not index.strip().isdigit() or not count.strip().isdigit():
        raise UsageError(f"--kvconform-shard {text!r}: expected I/N (e.g. 1/4: the first of 4 shards)")
    i, n = int(index), int(count)
    if not 1 <= i <= n:
        raise UsageError(f"--kvconform-shard {text!r}: I must be between 1 and N (got {i} of {n})")
    return i, n


SHARD_VARIABLES = (
    # (CI, index variable, count variable, index of the first job)
    ("GitLab CI (a job with parallel: N)", "CI_NODE_INDEX", "CI_NODE_TOTAL", 1),
    ("Buildkite (a step with parallelism: N)", "BUILDKITE_PARALLEL_JOB", "BUILDKITE_PARALLEL_JOB_COUNT", 0),
)
"""The variables in which a CI that runs one job many times in parallel tells each job its share (``--kvconform-shard
auto``). GitHub Actions has none: its matrix passes ``I/N`` explicitly."""
K8S_INDEX = "JOB_COMPLETION_INDEX"
"""A Kubernetes indexed Job's 0-based completion index; the count (``.spec.completions``) is not exported, so it is
given as ``--kvconform-shard auto/N``."""


def resolve_shard(text: str, environ=None) -> tuple[int, int, str]:
    """``--kvconform-shard`` → ``(I, N, where)``: ``"I/N"`` as given (``parse_shard``), or ``"auto"`` /
    ``"auto/N"`` read from the CI's own variables (``SHARD_VARIABLES``; a Kubernetes indexed Job's
    ``JOB_COMPLETION_INDEX`` with the count from ``auto/N``). ``where`` says where the share came from (``""`` for
    ``I/N``), e.g. ``"GitLab CI: CI_NODE_INDEX=2, CI_NODE_TOTAL=4"``. 1 ≤ I ≤ N, 1-based whatever the CI counts from.

    Raises:
        UsageError: not ``I/N``, ``auto`` or ``auto/N``; ``auto`` where no CI variable is set (naming every variable
            read, and GitHub Actions' matrix as the way there); a variable that is not an integer or out of range;
            half of a pair set; an ``auto/N`` whose N differs from the CI's count; two CIs' variables that disagree.
    """
    text = str(text).strip()
    if not text.startswith("auto"):
        return (*parse_shard(text), "")
    env = os.environ if environ is None else environ
    rest = text[len("auto"):]
    given = None
    if rest:
        if not rest.startswith("/") or not rest[1:].strip().isdigit() or int(rest[1:]) < 1:
            raise UsageError(f"--kvconform-shard {text!r}: expected auto, auto/N (N ≥ 1: the number of jobs) or I/N")
        given = int(rest[1:])
    found = []
    for ci, index_var, count_var, first in SHARD_VARIABLES:
        index, count = env.get(index_var, "").strip(), env.get(count_var, "").strip()
        if not index:
            continue  # GitLab sets CI_NODE_TOTAL=1 in every job, CI_NODE_INDEX only under parallel:
        if not count:
            raise UsageError(f"--kvconform-shard auto: {index_var}={index!r} is set but {count_var} is not "
                             f"({ci} sets both)")
        found.append((_share(text, ci, index_var, index, count_var, count, first), ci, index_var, index,
                      count_var, count))
    k8s = env.get(K8S_INDEX, "").strip()
    if k8s:
        if given is None:
            raise UsageError(f"--kvconform-shard auto: {K8S_INDEX}={k8s!r} (a Kubernetes indexed Job) does not say "
                             f"how many jobs there are: give their number, --kvconform-shard auto/N with N the "
                             f"Job's .spec.completions")
        found.append((_share(text, "Kubernetes indexed Job", K8S_INDEX, k8s, None, str(given), 0),
                      "Kubernetes indexed Job", K8S_INDEX, k8s, None, str(given)))
    if not found:
        read = "; ".join(f"{ci}: {i} and {n} ({'1' if first else '0'}-based)" for ci, i, n, first in SHARD_VARIABLES)
        raise UsageError(
            f"--kvconform-shard {text}: no CI variable says this job's share. Read: {read}; a Kubernetes indexed Job: "
            f"{K8S_INDEX} (0-based) with --kvconform-shard auto/N. GitHub Actions exports no such variable: pass the "
            f"matrix's values, --kvconform-shard ${{{{ matrix.shard }}}}/N. Elsewhere give I/N (e.g. 2/4)")
    shares = {share for share, *_ in found}
    if len(shares) > 1:
        said = ", ".join(f"{ci.split(' (')[0]} says {i}/{n}" for (i, n), ci, *_ in found)
        raise UsageError(f"--kvconform-shard {text}: the CI variables disagree ({said}); give I/N")
    (index, count), ci, index_var, index_value, count_var, count_value = found[0]
    if given is not None and given != count:
        raise UsageError(f"--kvconform-shard {text}: {ci.split(' (')[0]} runs {count} jobs "
                         f"({count_var}={count_value}), not {given}")
    where = f"{ci.split(' (')[0]}: {index_var}={index_value}" + (f", {count_var}={count_value}" if count_var else
                                                                  f", {count} jobs from auto/{count}")
    return index, count, where


def _share(text, ci, index_var, index, count_var, count, first) -> tuple[int, int]:
    """One CI's ``(I, N)``, 1-based, from its variables' values (``first``: the index of its first job)."""
    what = f"{index_var}={index!r}, " + (f"{count_var}={count!r}" if count_var else f"N={count}")
    if not index.isdigit() or not count.isdigit() or int(count) < 1:
        raise UsageError(f"--kvconform-shard {text}: {ci}: {what}: expected non-negative integers")
    i, n = int(index) - first + 1, int(count)
    if not 1 <= i <= n:
        raise UsageError(f"--kvconform-shard {text}: {ci}: {what}: the index is outside the {n} jobs "
                         f"({index_var} counts from {first})")
    return i, n


def item_cost(plan_item) -> float:
    """Estimated cost of one plan item (``session.PlanItem``; None for an item of another kind: cost 1): its
    ``PlanItem.cost`` (what its check declares, relative to a logits item; ``SKIPPED_COST`` when skipped)."""
    return 1.0 if plan_item is None else plan_item.cost


def shard_of(keys: list, costs: list[float], count: int, model_cost: float = MODEL_COST) -> list[int]:
    """The shard index (0-based) of each entry: ``keys`` (the model of each item, in the order items are run) group
    the entries; groups keep their first-appearance order, entries keep theirs within a group; the ordered list is
    cut into ``count`` contiguous parts of equal total cost (``costs`` plus ``model_cost`` per group), an entry
    going to the part its cost midpoint falls in. Deterministic: it depends only on the arguments."""
    order = {}
    for key in keys:
        order.setdefault(key, len(order))
    ranked = sorted(range(len(keys)), key=lambda i: (order[keys[i]], i))
    weights, seen = {}, set()
    for i in ranked:
        weights[i] = costs[i] + (model_cost if keys[i] not in seen else 0.0)
        seen.add(keys[i])
    total = sum(weights.values()) or 1.0
    out, done = [0] * len(keys), 0.0
    for i in ranked:
        out[i] = min(count - 1, int((done + weights[i] / 2) / total * count))
        done += weights[i]
    return out


def read_durations(path: str) -> dict[str, float]:
    """``{node id: seconds}`` of the items of the JSON report at ``path`` (each record's ``duration_s``, written
    since kvconform 0.1's per-item durations; a record without one is left out).

    Raises:
        UsageError: the file cannot be read, is not a schema-1 kvconform report, or holds no duration at all.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            payload = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot be read as a JSON report ({exc})") from None
    if not isinstance(payload, dict) or payload.get("schema") != 1 or not isinstance(payload.get("results"), list):
        raise UsageError("is not a kvconform JSON report (schema 1, written by --kvconform-json)")
    durations = {r["nodeid"]: float(r["duration_s"]) for r in payload["results"]
                 if isinstance(r, dict) and isinstance(r.get("nodeid"), str)
                 and isinstance(r.get("duration_s"), (int, float))}
    if not durations:
        raise UsageError("holds no item durations (a report written before kvconform recorded duration_s): "
                         "write a new one with --kvconform-json")
    return durations


def measured_costs(nodeids: list[str], estimates: list[float],
                   durations: dict[str, float]) -> tuple[list[float], float]:
    """``(costs, model_cost)`` in seconds: each item's measured duration where ``durations`` has it, else its
    estimate scaled to seconds by the measured items' ratio (their seconds over their estimates), and ``MODEL_COST``
    scaled the same way. With no item measured the estimates and ``MODEL_COST`` are returned as they are."""
    known = [(durations[n], e) for n, e in zip(nodeids, estimates) if n in durations]
    estimated = sum(e for _, e in known)
    if not known or estimated <= 0:
        return list(estimates), MODEL_COST
    scale = sum(d for d, _ in known) / estimated
    return [durations[n] if n in durations else e * scale for n, e in zip(nodeids, estimates)], MODEL_COST * scale


def select_shard(items: list, index: int, count: int,
                 durations: dict[str, float] | None = None) -> tuple[list, list]:
    """Split pytest ``items`` into ``(kept, deselected)`` for shard ``index`` of ``count`` (1-based), see the module
    docstring. Items without a kvconform plan item (another test of the session) are shared out by count. With
    ``durations`` (``{node id: seconds}`` of an earlier report, ``--kvconform-durations``) the cut balances measured
    seconds (``measured_costs``) instead of the static estimate."""
    plans = [getattr(getattr(it, "callspec", None), "params", {}).get("kv_item") for it in items]
    keys = [p.model.name if p is not None else "" for p in plans]
    # split in an order of their own (model, node id), not the run order: a plugin that shuffles items per process
    # (pytest-randomly, a different seed in every CI job) would otherwise give each job another split
    order = sorted(range(len(items)), key=lambda i: (keys[i], getattr(items[i], "nodeid", "")))
    costs, model_cost = [item_cost(plans[i]) for i in order], MODEL_COST
    if durations:
        costs, model_cost = measured_costs([getattr(items[i], "nodeid", "") for i in order], costs, durations)
    ranked = shard_of([keys[i] for i in order], costs, count, model_cost)
    shards = [0] * len(items)
    for position, i in enumerate(order):
        shards[i] = ranked[position]
    kept = [it for it, s in zip(items, shards) if s == index - 1]
    dropped = [it for it, s in zip(items, shards) if s != index - 1]
    return kept, dropped


# ------------------------------------------------------------------------------------------------------ merging
class MergeError(UsageError, ValueError):
    """The reports cannot be merged (unreadable, another schema, other environments, a shard missing or twice,
    one item with two outcomes); ``str`` names the file and the cause."""


_SAME_ENVIRONMENT = ("kvconform", "transformers", "torch", "device", "strict")


def merge_reports(reports: list[tuple[str, dict]]) -> dict:
    """One schema-1 report from the shards' reports ``[(path, payload), ...]``.

    The environment is the first report's, without its ``shard``, plus ``merged_from`` (the paths and shards);
    ``subjects`` / ``models`` orders are merged in first-appearance order; ``results`` is the union, sorted by node id.

    Raises:
        MergeError: see the class.
    """
    if not reports:
        raise MergeError("no reports given")
    first_path, first = reports[0]
    shards, results, subjects, models, owner = {}, {}, [], [], {}
    for path, payload in reports:
        if not isinstance(payload, dict) or payload.get("schema") != 1 or not isinstance(payload.get("results"), list):
            raise MergeError(f"{path}: not a kvconform JSON report of schema 1")
        env = payload.get("environment") or {}
        for key in _SAME_ENVIRONMENT:
            if env.get(key) != first.get("environment", {}).get(key):
                raise MergeError(f"{path}: {key} {env.get(key)!r} differs from {first_path}'s "
                                 f"{first['environment'].get(key)!r}; shards of one run must share their environment")
        shard = env.get("shard")
        if shard is not None:
            if shard in shards:
                raise MergeError(f"{path}: shard {shard} given twice (also {shards[shard]})")
            shards[shard] = path
        for key, into in (("subjects", subjects), ("models", models)):
            into.extend(n for n in env.get(key) or () if n not in into)
        for record in payload["results"]:
            old = results.get(record["nodeid"])
            if old is not None and old["outcome"] != record["outcome"]:
                raise MergeError(f"{path}: {record['nodeid']} is {record['outcome']} here but {old['outcome']} in "
                                 f"another report")
            if old is not None and shard is not None:
                raise MergeError(f"{path}: {record['nodeid']} is also in {owner[record['nodeid']]}: a split gives "
                                 f"every item to one shard, so these shards were split differently (another plan, "
                                 f"other -k / -m, or items split in a run order that differed between the jobs)")
            owner[record["nodeid"]] = path
            results[record["nodeid"]] = record
    _check_complete(shards, len(reports))
    environment = {k: v for k, v in first.get("environment", {}).items() if k != "shard"}
    environment.update(subjects=subjects, models=models,
                       merged_from=[{"path": p, "shard": (d.get("environment") or {}).get("shard"),
                                     **_progress(d)} for p, d in reports])
    from kvconform.digest import RunDigest
    from kvconform.report import power_section

    # the power tables of the whole run, from the records' power results (each shard ran its own items' mutants)
    power = power_section(results, RunDigest.from_environment(environment))
    return {"schema": 1, **merged_progress(reports), "environment": environment,
            "results": sorted(results.values(), key=lambda r: r["nodeid"]), **({"power": power} if power else {})}


def _progress(payload: dict) -> dict:
    from kvconform.report import progress_of

    return progress_of(payload)


def merged_progress(reports: list[tuple[str, dict]]) -> dict:
    """The merged report's state (``report.run_progress``'s keys): complete only when every report is; planned and
    finished summed (planned None when a report does not know its own); ``incomplete`` names each report that is not
    complete and why."""
    from kvconform.report import run_progress

    states = [(path, _progress(payload)) for path, payload in reports]
    planned = None if any(s["planned"] is None for _, s in states) else sum(s["planned"] for _, s in states)
    finished = sum(s["finished"] for _, s in states)
    cut = [f"{path}: {s['incomplete'] or 'not complete'}" for path, s in states if not s["complete"]]
    return run_progress(planned, finished, "; ".join(cut) if cut else None)


def _check_complete(shards: dict, given: int) -> None:
    """Every report of a split carries ``shard = "I/N"``: together they must be exactly ``1..N`` of one ``N``."""
    if not shards:
        return
    if len(shards) != given:
        raise MergeError("some reports come from a sharded run (--kvconform-shard) and some do not")
    counts = {parse_shard(s)[1] for s in shards}
    if len(counts) != 1:
        raise MergeError(f"the reports come from splits of different sizes: {sorted(shards)}")
    n = counts.pop()
    missing = sorted(set(range(1, n + 1)) - {parse_shard(s)[0] for s in shards})
    if missing:
        raise MergeError(f"shard(s) {', '.join(f'{i}/{n}' for i in missing)} missing: the merged matrix would "
                         f"leave out their items")


class _Lines:
    """The part of pytest's terminal reporter that ``report.write_terminal_matrix`` uses, writing to a stream."""

    def __init__(self, stream):
        self.stream = stream

    def section(self, title, **_):
        self.stream.write(f"{'=' * 20} {title} {'=' * 20}\n")

    def write_line(self, line="", **_):
        self.stream.write(f"{line}\n")


def main(argv=None) -> int:
    """``kvconform-merge [--json OUT] [--html PATH] [--junitxml OUT.xml] IN.json...``: write the merged report (and
    its page, ``html_report.write_html``, and its JUnit XML, ``junit.write_junit``), print the matrix, append the
    Markdown matrix to ``$GITHUB_STEP_SUMMARY`` when it is set. Exit 0 when every item conformed and every report is
    complete, 1 when any item failed or a report is not complete (interrupted or killed: its ``complete`` is false;
    the merged report says so too), 3 when kvconform's own code failed on an item (outcome ``internal``, listed as
    kvconform's own gaps), 2 when the reports cannot be merged (the message names the file and the cause). One
    report alone is merged as it is (a single run's JUnit XML). A ``transformers:*`` run also gets its
    per-architecture summary (``report.architecture_summary``: known upstream faults and unexplained failures per
    architecture), printed and in the step summary; an unexplained failure is a failed item, so exit 1."""
    from kvconform.report import (OUTCOMES, json_path_problem, markdown, own_gaps, reference_gaps,
                                  write_terminal_matrix)

    parser = argparse.ArgumentParser(prog="kvconform-merge", description="Merge the JSON reports of a sharded "
                                     "kvconform run (--kvconform-shard I/N) into one report, matrix and step summary.")
    parser.add_argument("--json", dest="out", metavar="OUT", help="write the merged JSON report here")
    parser.add_argument("--html", dest="html", metavar="PATH", help="write the merged conformance page here (one "
                        "self-contained HTML file, as --kvconform-html writes for one run)")
    parser.add_argument("--junitxml", dest="junit", metavar="OUT.xml",
                        help="write the merged report as JUnit XML (one testcase per item: class = subject, name = "
                             "item id) for CI dashboards")
    parser.add_argument("reports", nargs="+", metavar="IN.json", help="the shards' reports (--kvconform-json)")
    args = parser.parse_args(argv)
    try:
        loaded = []
        for path in args.reports:
            try:
                with open(path, encoding="utf-8") as fh:
                    loaded.append((path, json.load(fh)))
            except (OSError, ValueError) as exc:
                raise MergeError(f"{path}: cannot read it: {exc}") from None
        merged = merge_reports(loaded)
        for flag, out in (("--json", args.out), ("--html", args.html), ("--junitxml", args.junit)):
            if out and (problem := json_path_problem(out)):
                raise MergeError(f"{flag} {out!r}: {problem}")
    except MergeError as exc:
        print(f"kvconform-merge: {exc}", file=sys.stderr)
        return 2
    results = {r["nodeid"]: r for r in merged["results"]}
    reference_gaps(results)  # the reference and DynamicCache may have run in different shards
    if args.out:
        _write_json(args.out, merged)
    if args.html:
        from kvconform.html_report import write_html

        write_html(args.html, merged)
    if args.junit:
        from kvconform.junit import write_junit

        write_junit(args.junit, merged)
    from kvconform.digest import RunDigest

    order = RunDigest.from_environment(merged["environment"])
    write_terminal_matrix(_Lines(sys.stdout), results, order)
    counts = {o: sum(r["outcome"] == o for r in results.values()) for o in OUTCOMES}
    print(f"kvconform-merge: {len(results)} items from {len(loaded)} report(s): "
          + ", ".join(f"{n} {o}" for o, n in counts.items() if n))
    if not merged["complete"]:
        planned = merged["planned"] if merged["planned"] is not None else "an unknown number of"
        print(f"kvconform-merge: INCOMPLETE: {merged['finished']} of {planned} planned items finished; "
              f"{merged['incomplete']}. The merged report says complete: false", file=sys.stderr)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary and results:
        with open(summary, "a", encoding="utf-8") as fh:
            fh.write(markdown(results, order))
            if not merged["complete"]:
                fh.write(f"\n**INCOMPLETE**: {merged['finished']} of {merged['planned'] or '?'} planned items "
                         f"finished ({merged['incomplete']}).\n")
    for line in own_gaps(results, order):
        print(f"kvconform-merge: {line}")
    from kvconform.report import architecture_summary

    arch = architecture_summary(results)
    for line, _ in arch:
        print(f"kvconform-merge: {line}")
    if summary and arch:
        with open(summary, "a", encoding="utf-8") as fh:
            fh.write("\n**Per architecture** (known faults: xfailed by known_faults.toml; unexplained: failed)\n\n```\n"
                     + "\n".join(line for line, _ in arch) + "\n```\n")
    if counts["internal"]:
        return 3
    return 1 if counts["failed"] or counts["error"] or not merged["complete"] else 0


def _write_json(path: str, payload: dict) -> None:
    from kvconform.digest import write_atomically

    write_atomically(path, json.dumps(payload, indent=1, ensure_ascii=False))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
