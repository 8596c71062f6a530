"""The plan of a kvconform run (subjects × models × cases) and the per-process state that runs it.

Built once per process in ``pytest_configure`` (xdist workers build their own, identically: everything is sorted
and ids contain no addresses). Models and oracles are built lazily, once per (model, dtype).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvconform import scratch, zoo
from kvconform.plan import (ModelInfo, PlanItem, in_scope, model_info, most_tokens_held,  # noqa: F401 - re-exported
                            same_kind, skip_reason, stands_in_for, zoo_features)
from kvconform.plan import architecture_names as _architecture_names
from kvconform.plan import external as _external
from kvconform.plan import zoo_family as _zoo_family
from kvconform.outcomes import UsageError, breadcrumb
from kvconform.memo import MEMO
from kvconform.digest import RunDigest, SubjectFacts
from kvconform.run_options import RunOptions

if TYPE_CHECKING:
    from kvconform.known_faults import FaultIndex


@dataclass
class KVSession:
    """Per-process state: the resolved subjects, models, cases, known faults and the built models."""

    subjects: list
    models: list
    cases: list
    checks: dict
    faults: list
    options: RunOptions = field(default_factory=RunOptions)
    """The run's options (``RunOptions``: strict, full, device, fuzz seed, power, shard, the reproduce line's
    flags, ...), passed on to each item's ``CheckContext``."""
    _built: dict = field(default_factory=dict)
    _fault_memo: dict = field(default_factory=dict)
    _fault_index: FaultIndex | None = None
    notes: list = field(default_factory=list)
    architectures: list = field(default_factory=list)
    """``(spec, records)`` per ``transformers:PATTERN`` model spec: every architecture tried, built or not and
    why (``sweep.survey``); listed in the header and the JSON report."""
    """Extra header lines (a repository's own cache classes found, ``remote.py``)."""
    _oracles: dict = field(default_factory=dict)
    power_scope: set | None = None
    """The ids of the items this process may run (after ``-k`` / ``-m`` / ``--kvconform-shard``; set by the plugin),
    the ones the sampled power pass samples from; None: every planned item."""
    _power_plan: dict | None = None
    _power_killed: set = field(default_factory=set)

    @property
    def strict(self) -> bool:
        """``options.strict``: known upstream faults fail."""
        return self.options.strict

    @property
    def device(self) -> str:
        """``options.device``: the models' torch device."""
        return self.options.device

    @property
    def full(self) -> bool:
        """``options.full``: the heavier tier."""
        return self.options.full

    def items(self) -> list[PlanItem]:
        out = []
        for case in self.cases:
            check = self.checks[case.check]
            for subject in self.subjects:
                for model in self.models:
                    if not in_scope(subject, model, case, self.full, check):
                        continue
                    skip = skip_reason(subject, model, check, case, self.device)
                    xfail = (subject.expected_failures.get(f"{check.name}:{case.id}")
                             or subject.expected_failures.get(check.name))
                    item = PlanItem(subject, model, check, case, skip, xfail)
                    if not xfail and not self.strict:  # entries with evidence are judged at run time (run)
                        item = PlanItem(subject, model, check, case, skip, self.known_fault(item, marked=True))
                    out.append(item)
        return out

    @property
    def reference(self):
        return next(s for s in self.subjects if s.name == "ReferenceCache") if any(
            s.name == "ReferenceCache" for s in self.subjects) else _reference_spec()

    def zoo_model(self, model: ModelInfo, dtype_name: str):
        import torch

        key = (model.spec, dtype_name)
        if key not in self._built:  # its source builds it (a zoo model, a checkpoint, a model adapter's)
            self._built[key] = model.source.build(getattr(torch, dtype_name), device=self.device,
                                                  trust_remote_code=model.trust_remote_code)
        return self._built[key]

    def oracle(self, zm):
        from kvconform.oracle import Oracle

        if id(zm) not in self._oracles:
            self._oracles[id(zm)] = Oracle(zm)
        return self._oracles[id(zm)]

    def run(self, item: PlanItem, benchmark=None) -> dict:
        """Run one item; return its metrics. Raises ``ConformanceError`` on non-conformance, ``CheckSkipped`` when
        the check cannot measure here. ``benchmark``: the pytest-benchmark fixture for speed items (or None)."""
        import torch

        from kvconform.checks import CheckContext, ConformanceError, run_check

        breadcrumb("building the model, the oracle and the cache (before the case's first op)", item=item.id)
        torch.manual_seed(0)
        zm = self.zoo_model(item.model, item.case.dtype)
        reference = self.reference if item.model.source.has_reference else None  # none on a from-scratch model
        ctx = CheckContext(item.subject, zm, item.case, self.oracle(zm), reference=reference,
                           known_fault=self.known_fault(item), benchmark=benchmark, options=self.options)
        try:
            metrics = run_check(item.check.name, ctx)
        except ConformanceError as exc:
            if item.xfail is None:
                self.judge_known_fault(item, ctx, exc)
            raise
        mutants = self.power_mutants(item) if item.xfail is None else []
        if mutants:  # the item passed: its power on this subject (a mutant never changes the item's outcome)
            import time

            from kvconform.checks import run_power

            start = time.perf_counter()
            power = run_power(item.check.name, ctx, mutants)
            metrics["power"] = power
            metrics["power_s"] = round(time.perf_counter() - start, 4)
            self._power_killed.update((item.subject.name, item.check.family, name)
                                      for name, result in power.items() if result == "killed")
        return metrics

    def power_mutants(self, item: PlanItem) -> list:
        """The mutants (``checks._power.Mutant``) the power pass runs on ``item`` once it has passed: none under
        ``--kvconform-power off`` or for kvconform's own subjects unless ``full``; under ``full`` every candidate
        (``_power.candidates``); under ``sampled`` those of which ``item`` is among the first ``_power.SAMPLE``
        candidate items of its subject × family × mutant (by estimated cost, then item id: the same in every
        process), less those an earlier item of this process already killed."""
        from kvconform.checks._power import SAMPLE, candidates, is_own

        power = self.options.power
        if power == "off" or (power != "full" and is_own(item.subject)):
            return []
        found = candidates(item.subject, item.check, item.case)
        if power == "full" or not found:
            return found
        if self._power_plan is None:
            ranked: dict = {}
            for other in self.items():
                if other.skip or other.xfail or is_own(other.subject) or (
                        self.power_scope is not None and other.id not in self.power_scope):
                    continue
                for mutant in candidates(other.subject, other.check, other.case):
                    key = (other.subject.name, other.check.family, mutant.name)
                    ranked.setdefault(key, []).append((getattr(other.check, "cost", 1.0), other.id))
            plan: dict = {}
            for key, ids in ranked.items():
                for _, item_id in sorted(ids)[:SAMPLE]:
                    plan.setdefault(item_id, set()).add(key[2])
            self._power_plan = plan
        chosen = self._power_plan.get(item.id, set())
        return [m for m in found if m.name in chosen
                and (item.subject.name, item.check.family, m.name) not in self._power_killed]

    def expected_fault(self, item: PlanItem, own_failures: bool = True):
        """The known-fault entry matching ``item`` on the installed transformers, or None (``own_failures``: also
        None when the subject's own ``expected_failures`` cover the item). A checkpoint gets an entry when it
        matches *every* zoo model of the checkpoint's kind (same features): then it is a fault of that kind of model
        or cache, not of one family's modeling code (a fault of Jamba's chunked continuation says nothing about
        another hybrid architecture)."""
        if not item.model.source.transformers_faults:
            return None  # a model outside transformers has no transformers faults (kvconform.scratch)
        if own_failures and (item.subject.expected_failures.get(f"{item.check.name}:{item.case.id}") or
                             item.subject.expected_failures.get(item.check.name)):
            return None
        fault = self.fault_entry(**item.describe())
        same = _zoo_family(item.model.spec)
        if fault is None and same:  # transformers:<type> of a zoo family: that family's modeling code, its faults
            fault = self.fault_entry(**{**item.describe(), "model": same})
        if fault is None and (_external(item.model.spec) or item.model.spec in zoo.VLM_NAMES):
            kind = same_kind(item.model)
            found = [self.fault_entry(**{**item.describe(), "model": name}) for name in kind]
            fault = found[0] if kind and all(f is not None for f in found) else None
        return fault

    def known_fault(self, item: PlanItem, marked: bool = False) -> str | None:
        """The known-fault reason for ``item`` on the installed transformers (strict or not), or None.
        ``marked``: only entries that mark items before they run (no ``evidence``: an entry with evidence excuses a
        failure only when the failure shows it, decided in ``run``)."""
        fault = self.expected_fault(item, own_failures=False)
        if fault is None or (marked and fault.judged_at_run_time):
            return None
        return self._fault_reason(item, fault)

    def judge_known_fault(self, item: PlanItem, ctx, exc) -> None:
        """Judge a failure ``exc`` (``ConformanceError``) of ``item`` against the known faults, at run time.

        Raises ``KnownFaultShown`` (xfail) when an entry judged at run time matches the item by name and the
        failure shows it (``evidence``) inside its ``envelope``, or when the subject inherits the fault's
        transformers method unchanged (``known_faults.find_inherited``; under ``--kvconform-strict`` the failure
        is raised again with the inherited fault named); raises ``ConformanceError`` naming the entry when a
        failure lies outside the envelope of the entry naming the item (the subject's own, worse or other fault).
        Returns when no entry speaks about the failure (the caller re-raises it)."""
        from kvconform import known_faults
        from kvconform.checks import ConformanceError, KnownFaultShown
        from kvconform.compat import transformers_version

        fault = self.expected_fault(item)
        if fault is not None:
            if not fault.judged_at_run_time:
                return
            for other in [fault] + self._other_run_time_faults(item, fault):
                if other.shown_by(str(exc), _cause_id(exc)) and other.within(exc.metrics):
                    if not self.strict:
                        raise KnownFaultShown(self._fault_reason(item, other), exc.metrics) from None
                    return
            why = fault.outside(exc.metrics) or (
                f"its likely cause is not {fault.cause!r}" if fault.cause is not None
                and _cause_id(exc) != fault.cause else f"the message does not show {fault.evidence!r}")
            raise ConformanceError(f"{exc}\n  not known upstream fault {fault.id!r}: this failure lies outside what "
                                   f"that fault does ({why}), so it is the subject's own", exc.metrics,
                                   failure=getattr(exc, "failure", None)) from None
        if not item.model.source.transformers_faults:
            return  # its cache inherits no transformers method that a known fault lives in
        try:
            cache = ctx.new_cache()
        except Exception:  # noqa: BLE001 - a subject that cannot be built inherits nothing we can show
            return
        names = item.describe()

        def inherited_on(model):
            return known_faults.find_inherited(
                self.faults, transformers_version(), cache, model, names["check"], names["case"],
                names["family"], metrics=exc.metrics, message=str(exc), raised=_subject_exception(exc),
                cause_id=_cause_id(exc))

        # the models an entry may name for this item, as for the entries naming subjects (expected_fault): its own,
        # its zoo family's, and for a checkpoint or a zoo VLM every zoo model of its kind (all of them)
        inherited, method = inherited_on(names["model"])
        same = _zoo_family(item.model.spec)
        if inherited is None and same:
            inherited, method = inherited_on(same)
        if inherited is None and (_external(item.model.spec) or item.model.spec in zoo.VLM_NAMES):
            found = [inherited_on(name) for name in same_kind(item.model)]
            if found and all(f[0] is not None for f in found):
                inherited, method = found[0]
        if inherited is None:
            return
        reason = (f"known upstream fault {inherited.id!r}, inherited from transformers' {method} (used unchanged by "
                  f"{item.subject.name}): {inherited.reason}")
        if not self.strict:
            raise KnownFaultShown(reason, exc.metrics) from None
        raise ConformanceError(f"{exc}\n  {reason}", exc.metrics, failure=getattr(exc, "failure", None)) from None

    def _other_run_time_faults(self, item: PlanItem, first) -> list:
        """The entries judged at run time, other than ``first``, that name ``item`` by its own model or its zoo
        family's (a release can have two faults reaching one item: transformers 5.25's recording TypeError comes
        before 5.24's dropped decode mask on the hybrids that do not run a Mamba scan)."""
        from kvconform import known_faults
        from kvconform.compat import transformers_version

        if self._fault_index is None:
            self._fault_index = known_faults.FaultIndex(self.faults, transformers_version())
        d = item.describe()
        models = [d["model"]] + [m for m in [_zoo_family(item.model.spec)] if m]
        candidates = [f for model in models for f in self._fault_index.find_all(**{**d, "model": model})]
        if _external(item.model.spec) or item.model.spec in zoo.VLM_NAMES:  # entries naming every model of its kind
            kind = same_kind(item.model)
            per_model = [self._fault_index.find_all(**{**d, "model": name}) for name in kind]
            candidates += [f for f in (per_model[0] if per_model else []) if all(f in p for p in per_model)]
        found: list = []
        for fault in candidates:
            if fault is not first and fault.judged_at_run_time and fault not in found:
                found.append(fault)
        return found

    def _fault_reason(self, item: PlanItem, fault) -> str:
        if fault.matches_fields(model=item.model.name):
            return fault.reason
        same = _zoo_family(item.model.spec)
        if same and fault.matches_fields(model=same):
            return f"{fault.reason} (known on the zoo's {same}: the same modeling code)"
        kind = same_kind(item.model)
        return f"{fault.reason} (known on every zoo model of this kind: {', '.join(kind)})"

    def fault_entry(self, subject: str, model: str, check: str, family: str, case: str):
        """The first ``known_faults.KnownFault`` matching this item (names) on the installed transformers, or None."""
        key = (subject, model, check, family, case)
        if key not in self._fault_memo:  # looked up per item and per zoo model of its kind: memoised
            from kvconform import known_faults
            from kvconform.compat import transformers_version

            if self._fault_index is None:
                self._fault_index = known_faults.FaultIndex(self.faults, transformers_version())
            self._fault_memo[key] = self._fault_index.find(subject, model, check, case, family)
        return self._fault_memo[key]

    def stale_faults(self) -> list:
        """Known-fault entries that apply to the installed transformers and to the run's models but match no item
        kvconform plans for this run's subjects and cases over the whole zoo plus the run's models, both tiers
        (so an entry for a full-tier case or for a subject that skips here is not stale; a typo'd case id is).

        Returns:
            ``known_faults.KnownFault`` objects in file order.
        """
        from kvconform import known_faults
        from kvconform.compat import transformers_version

        names = {m.name for m in self.models}
        live = known_faults.live(self.faults, transformers_version(), names, {s.name for s in self.subjects})
        if not live:
            return []
        universe = [*self.models, *(model_info(n, zoo_only=True, read_forward=False)
                                    for n in zoo.ALL_NAMES if n not in names)]
        # an entry is hit when an item in scope matches all its fields; the planned items (thousands) are pruned
        # field by field, since most cases match no live entry at all
        hit: set = set()
        for case in self.cases:
            check = self.checks[case.check]
            by_case = [f for f in live if f.id not in hit and
                       f.matches_fields(check=check.name, family=check.family, case=case.id)]
            for subject in self.subjects if by_case else ():
                by_subject = [f for f in by_case if f.id not in hit and f.matches_fields(subject=subject.name)]
                for model in universe if by_subject else ():
                    pending = [f for f in by_subject if f.id not in hit and f.matches_fields(model=model.name)]
                    if pending and in_scope(subject, model, case, full=True):
                        hit.update(f.id for f in pending)
        return [f for f in live if f.id not in hit]

    def environment(self) -> dict:
        import torch
        import transformers

        import kvconform

        return {"kvconform": kvconform.__version__, "python": platform.python_version(),
                "torch": torch.__version__, "transformers": transformers.__version__,
                "platform": platform.platform(), "device": self.device,
                "cuda_available": bool(torch.cuda.is_available()), "strict": self.strict,
                # the run's orders (kvconform-merge keeps them) and its share of a sharded run
                "subjects": [s.name for s in self.subjects], "models": [m.name for m in self.models],
                "power": self.options.power,
                **({"shard": self.options.shard} if self.options.shard else {}),
                **({"architectures": [r for _, records in self.architectures for r in records]}
                   if self.architectures else {})}

    def digest(self):
        """The ``digest.RunDigest`` of this session: what the reports need (header, environment, subjects' facts,
        the plan's items, the known faults that name them, the stale ones), as plain data. ~0.1 s for the default
        run's 1,980 items."""
        from kvconform.subjects import FRESH, kind_of

        builtin = _builtin_names()
        subjects = []
        for spec in self.subjects:
            kind = kind_of(spec)
            subjects.append(SubjectFacts(name=spec.name, kind=kind.name, builtin=spec.name in builtin,
                                         fresh_target=kind.target == FRESH, source=spec.source,
                                         expected_failures=sorted(spec.expected_failures)))
        fresh = {s.name for s in subjects if s.fresh_target}
        items, faults, costs = {}, {}, {}
        for item in self.items():
            d = item.describe()
            items[item.id] = item.record()
            costs[item.id] = item.cost
            fault = self.fault_entry(**d)
            if fault is not None:
                shared = d["subject"] in fresh and self.fault_entry(**{**d, "subject": "ReferenceCache"}) is not None
                faults[item.id] = {"id": fault.id, "shared_by_fresh": shared,
                                   "judged_at_run_time": fault.judged_at_run_time}
        return RunDigest(
            header=self.header_lines(), environment=self.environment(), subjects=subjects,
            models=[m.name for m in self.models], model_specs={m.name: m.spec for m in self.models},
            strict=self.strict, known_faults=faults, items=items, reproduce_args=list(self.options.reproduce_args),
            costs=costs,
            stale_faults=[{"id": f.id, "transformers": f.transformers, "source": f.source}
                          for f in self.stale_faults()])

    def header_lines(self) -> list[str]:
        env = self.environment()
        return [
            f"kvconform {env['kvconform']}: transformers {env['transformers']}, torch {env['torch']}, "
            f"device {self.device}, known faults {'fail (strict)' if self.strict else 'xfail'}",
            self._subjects_line(),
            f"kvconform models: {', '.join(m.name for m in self.models)}; cases: {len(self.cases)}"
            + ("" if self.full else f" (full tier, not run: {sum(c.tier == 'full' for c in self.cases)} cases, "
                                    f"{sum(c.models_full is not None for c in self.cases)} on more models"
                                    + (f", the vision-language models {', '.join(zoo.VLM_NAMES)}"
                                       if not any(m.name in zoo.VLM_NAMES for m in self.models) else "")
                                    + (f", the audio encoder-decoder {', '.join(zoo.AUDIO_NAMES)}"
                                       if not any(m.name in zoo.AUDIO_NAMES for m in self.models) else "")
                                    + "; add --kvconform-full)")
            + ("" if self.options.fuzz_seed is None else f"; fuzz seed {self.options.fuzz_seed} (replay: "
                                                         f"--kvconform-fuzz-seed {self.options.fuzz_seed})"),
            *(self._checkpoint_coverage(m) for m in self.models if m.source.folder() is not None),
            *self.notes,
            *self._architecture_lines(),
        ]

    def _subjects_line(self) -> str:
        """``kvconform subjects: ...``: the subjects that have items on the models of the run (``plan.serves``),
        and how many others there are (built-in caches that never run on a model written from scratch, a
        ``QuantizedCache`` on models with other layers than full attention)."""
        from kvconform.plan import serves

        running = [s.name for s in self.subjects if any(serves(s, m) for m in self.models)]
        others = len(self.subjects) - len(running)
        return (f"kvconform subjects: {', '.join(running) or 'none'}"
                + (f" ({others} other subject{'s run' if others != 1 else ' runs'} on none of these models)"
                   if others else ""))

    def _architecture_lines(self) -> list[str]:
        """Per ``transformers:PATTERN`` spec: how many architectures were built and checked, then one line per
        architecture: its layer-type features, or why it was not built."""
        lines = []
        infos = {m.name: m for m in self.models}
        for spec, records in self.architectures:
            built = [r for r in records if r["built"]]
            lines.append(f"kvconform architectures {spec}: {len(built)} of {len(records)} built and checked; "
                         f"{len(records) - len(built)} not built (reasons below)")
            for r in records:
                info = infos.get(r["name"])
                if r["built"] and info is not None:
                    lines.append(f"  {r['name']}: built ({', '.join(sorted(info.features))}; layers "
                                 f"{'/'.join(info.layer_types)}" + (f"; {r['image']}" if r.get("image") else "")
                                 + ")")
                elif not r["built"]:
                    lines.append(f"  {r['name']}: not built: {r['reason']}")
        return lines

    def _checkpoint_coverage(self, model: ModelInfo) -> str:
        """One header line per checkpoint: how many cases apply to it, and why the others do not."""
        from kvconform.cases import model_requirements_unmet

        left = {"other kinds of model": 0, "features it lacks": 0, "the full tier": 0}
        applies = 0
        for case in self.cases:
            scope = case.model_scope(self.full)
            if (case.tier == "full") and not self.full:
                left["the full tier"] += 1
            elif scope and model.name not in scope and not stands_in_for(model, scope):
                left["other kinds of model"] += 1
            elif model_requirements_unmet(case, model.features):
                left["features it lacks"] += 1
            else:
                applies += 1
        why = ", ".join(f"{n} for {reason}" for reason, n in left.items() if n)
        return (f"kvconform checkpoint {model.name} ({', '.join(sorted(model.features))}): {applies} of "
                f"{len(self.cases)} cases apply" + (f"; left out: {why}" if why else ""))


@functools.cache  # the catalogue is fixed for the process (installed packages, transformers release)
def _builtin_names() -> frozenset:
    from kvconform.subjects import builtin_subjects

    return frozenset(s.name for s in builtin_subjects())


def _reference_spec():
    from kvconform.subjects import builtin_subjects

    return builtin_subjects()[0]


def _limit_threads():
    """One intra-op thread per process: the zoo models are tiny (hidden 64), so more threads only add
    synchronisation, and under pytest-xdist or a busy CI machine OpenMP threads oversubscribe the cores and
    spin (measured here: several times slower). ``KVCONFORM_THREADS`` overrides it."""
    import os

    import torch

    torch.set_num_threads(int(os.environ.get("KVCONFORM_THREADS", "1")))


def _quiet_transformers():
    """transformers logs a warning per kernel fallback ("causal_conv1d is not installed ...") in every Mamba item;
    keep its logger at ERROR during a kvconform run so failures stay readable."""
    import warnings

    from transformers.utils import logging

    logging.set_verbosity_error()
    # transformers.cache_utils imports hqq when it is installed, and hqq's import-time torch.jit.script calls emit
    # 14 DeprecationWarnings that say nothing about any cache: import it once here, with them silenced.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import transformers.cache_utils  # noqa: F401


def _import_backends_quietly(subjects) -> None:
    """Import the optional backends the run's subjects require (``CacheSpec.requires``, e.g. hqq) once, up front,
    with their import-time ``DeprecationWarning`` s silenced: hqq compiles functions with ``torch.jit.script``, and
    each import otherwise adds 14 torch deprecation warnings to the run's summary that say nothing about the cache.
    Backends that are not installed are left alone (their items skip with the install hint)."""
    import importlib
    import warnings

    from kvconform.compat import missing_requirement

    for module in dict.fromkeys(r.partition(":")[0] for s in subjects for r in s.requires):
        if missing_requirement(module):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                importlib.import_module(module)
                if module == "hqq":
                    importlib.import_module("hqq.core.quantize")
            except Exception:  # noqa: BLE001 - a backend that fails to import is reported by its items
                pass


def build_session(caches=(), models=(), case_paths=(), builtin=True, checks=None, case_ids=None, known_faults=(),
                  only_subjects=(), runs_items=True, extra_models=(), options: RunOptions | None = None,
                  **run_options) -> KVSession:
    """Resolve everything the user passed into a ``KVSession``.

    Args:
        options, run_options: the run's ``RunOptions`` (default: the defaults), with ``run_options`` (its field
            names: ``strict=True``, ``device="cuda"``, ``full=True``, ``trust_remote_code=True``, ...) applied
            (``RunOptions.of``).
        caches: extra subjects — ``"module:attr"`` strings, ``CacheSpec`` objects, Cache subclasses or factories.
        models: zoo names / checkpoint folders (default: the whole zoo).
        case_paths: extra case files or folders.
        builtin: include the built-in subjects (ReferenceCache, DynamicCache, StaticCache, ...).
        checks: if given, only cases running these check names.
        case_ids: if given, only these case ids.
        known_faults: extra known-faults files, read after the bundled ``known_faults.toml``.
        only_subjects: if given, keep only the subjects of these names (built-in or added); the reference cache
            still runs for the oracle line of each failure.
        extra_models: models added to ``models`` (or to the default ones): model adapters the
            ``pytest_kvconform_caches`` hook returned (``kvconform.scratch``).
        runs_items: False for a session that only plans and reports (a pytest-xdist controller, whose workers run
            the items): the subjects' optional backends (quanto: ~1.1 s) are not imported.

    Raises:
        UsageError (``SpecError``, ``CaseFileError``, ``KnownFaultsError``): bad input, naming the spec / file and
            the cause.
    """
    from kvconform.cases import load_cases
    from kvconform.checks import FAMILIES, load_checks
    from kvconform.known_faults import load_all
    from kvconform.subjects import CacheSpec, as_cache_spec, builtin_subjects, check_factory_builds_cache, validate_spec

    from kvconform.plan import spec_problem

    options = RunOptions.of(options, **run_options)
    device, full, trust_remote_code = options.device, options.full, options.trust_remote_code
    # a model adapter given as a Python object (check_cache, parametrize_with_checks): its module:Class spec
    models = [scratch.register_adapter(m) if not isinstance(m, str) else m for m in models or ()]
    # a mistyped model spec is a usage error before torch and transformers are imported (~5 s)
    for spec in models or ():
        if isinstance(spec, str) and (problem := spec_problem(spec, trust_remote_code)):
            raise UsageError(problem)
    # the user's subjects first: a spec that does not import (or names no attribute of its module) is refused before
    # the checks, cases and built-in subjects are loaded, seconds sooner in every process that builds a session
    MEMO.clear()  # a new run measures afresh (the process's memo tables: kvconform.memo)
    _quiet_transformers()
    _limit_threads()
    from kvconform.compat import strict_float32

    strict_float32(device)  # CUDA: no TF32 while float32 is judged against float32 tolerances
    resolved = [(obj, as_cache_spec(obj)) for obj in caches or ()]
    registry = load_checks()
    subjects = builtin_subjects() if builtin else []
    builtin_names = {s.name for s in subjects}
    cases = load_cases(case_paths, known_checks=registry)
    for obj, subject in resolved:
        where = f"--kvconform-cache {obj!r}" if isinstance(obj, str) else (
            f"CacheSpec {subject.name!r} (pytest_kvconform_caches hook or Python)" if isinstance(obj, CacheSpec)
            else f"{subject.name} (from Python)")
        validate_spec(subject, where, set(registry), {c.id for c in cases})
        check_factory_builds_cache(subject, zoo.zoo_config("llama"))
        if any(s.name == subject.name for s in subjects):
            kind = "a built-in subject" if subject.name in builtin_names else "another subject"
            raise UsageError(f"{where}: {kind} is already named {subject.name!r}; give yours another name (rename "
                             f"the class or factory, or return kvconform.CacheSpec(name=..., factory=...) from a "
                             f"pytest_kvconform_caches hook)")
        subjects.append(subject)
    # the vision-language models are heavier (a vision tower per prefill): the full tier, or named explicitly
    # the full tier also runs the worked from-scratch examples (kvconform.scratch.EXAMPLES); named, they run alone
    default = (*zoo.ALL_NAMES, *scratch.EXAMPLES) if full else zoo.ZOO_NAMES
    extra = [scratch.register_adapter(m) for m in extra_models]
    infos, surveyed = _model_infos([*(models or default), *extra], trust_remote_code)
    names = [i.name for i in infos]
    if len(set(names)) != len(names):
        raise UsageError(f"--kvconform-model: duplicate model names {names}")
    for name in checks or ():
        if name not in registry:
            raise UsageError(f"unknown check {name!r}; known: {', '.join(sorted(registry))}")
    if checks:
        cases = [c for c in cases if c.check in set(checks)]
    if case_ids:
        unknown = set(case_ids) - {c.id for c in cases}
        if unknown:
            raise UsageError(f"unknown case id(s) {sorted(unknown)}")
        cases = [c for c in cases if c.id in set(case_ids)]
    faults = load_all(known_faults, checks=set(registry), families={*FAMILIES, *(c.family for c in registry.values())},
                      models={*zoo.ALL_NAMES, *names, *_architecture_names()})
    session = KVSession(subjects, infos, cases, registry, faults, options)
    session.architectures = surveyed
    for info in infos:
        if info.source.brings_subjects:  # a model written from scratch: its adapter's caches are subjects
            _add_adapter_subjects(session, info, set(registry), {c.id for c in cases})
            continue
        # a checkpoint folder: load it now (kept for the items) and refuse non-causal ones
        if info.source.folder() is not None:
            _refuse_unusable_checkpoint(session, info)
            if info.trust_remote_code:
                _add_repository_subjects(session, info, set(registry), {c.id for c in cases})
    if only_subjects:
        session.subjects = _select_subjects(session.subjects, only_subjects)
    if runs_items:
        _import_backends_quietly(session.subjects)
    return session


def _model_infos(specs, trust_remote_code: bool) -> tuple[list, list]:
    """``ModelInfo`` per model spec; a ``transformers:PATTERN`` spec stands for every architecture it matches that
    builds and is a causal language model keeping a cache (``sweep.survey``). Returns ``(infos, [(spec, records)])``.

    Raises:
        UsageError: a bad spec (``model_info``), a pattern matching no architecture, no model left to run (every
            architecture refused, each reason listed).
    """
    from kvconform import architectures, sweep

    infos, surveyed = [], []
    for spec in specs:
        if not architectures.is_architecture_spec(spec):
            infos.append(model_info(spec, trust_remote_code=trust_remote_code))
            continue
        records = sweep.survey(spec.removeprefix(architectures.PREFIX), causality_gap, CAUSALITY_TOLERANCE)
        surveyed.append((spec, records))
        infos += [ModelInfo(r["name"], architectures.PREFIX + r["model_type"], tuple(r["layer_types"]), False,
                            bool(r["accepts_position_ids"])) for r in records if r["built"]]
    if not infos and surveyed:  # every architecture refused: nothing to run, each with its reason
        refused = [f"{r['name']}: {r['reason']}" for _, records in surveyed for r in records][:10]
        raise UsageError(f"--kvconform-model {', '.join(spec for spec, _ in surveyed)}: no architecture it names "
                         f"can be run — " + "; ".join(refused))
    return infos, surveyed


def _add_repository_subjects(session, info, known_checks, known_cases) -> None:
    """Add the cache classes of a repository's own code (``remote.repository_cache_subjects``) as subjects."""
    from kvconform import remote
    from kvconform.subjects import check_factory_builds_cache, validate_spec

    zm = session.zoo_model(info, "float32")
    found, lines = remote.repository_cache_subjects(zm, info.spec)
    for subject in found:
        where = f"--kvconform-model {info.spec!r} (its own cache class {subject.name})"
        validate_spec(subject, where, known_checks, known_cases)
        check_factory_builds_cache(subject, zm.config)
        if any(s.name == subject.name for s in session.subjects):
            raise UsageError(f"{where}: another subject is already named {subject.name!r}")
        session.subjects.append(subject)
    session.notes.extend(lines)


def _add_adapter_subjects(session, info, known_checks, known_cases) -> None:
    """Add the caches of a model adapter (``kvconform.scratch``) as subjects, after checking that its uncached
    forward can be the float64 oracle.

    Raises:
        scratch.AdapterUsageError: the float64 forward fails (``scratch.float64_problem``) or a subject name is
            taken.
    """
    from kvconform.subjects import validate_spec

    for subject in info.source.own_subjects():
        where = f"--kvconform-model {info.spec!r} (its cache {subject.name})"
        validate_spec(subject, where, known_checks, known_cases)
        if any(s.name == subject.name for s in session.subjects):
            raise scratch.AdapterUsageError(f"{where}: another subject is already named {subject.name!r}; rename "
                                            f"it in the adapter's caches")
        session.subjects.append(subject)


def _select_subjects(subjects: list, names) -> list:
    """The subjects named in ``names`` (``--kvconform-subject``), in the run's order.

    Raises:
        UsageError: a name that is no subject of this run (with the closest name and the list).
    """
    import difflib

    known = [s.name for s in subjects]
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"--kvconform-subject {name!r}: no such subject{hint} (subjects of this run: "
                             f"{', '.join(known)}; add yours with --kvconform-cache)")
    return [s for s in subjects if s.name in set(names)]


def causality_gap(zm) -> float:
    """How much the logits of positions ``0..3`` change when only the tokens after them (positions ``4..7``)
    change, relative to the logits' size: ``0`` (up to float rounding, ~1e-7) for a causal language model, where a
    position never sees later tokens; far larger for a bidirectional encoder loaded under a language-model head
    (e.g. BERT), whose every position attends to every other.

    Returns ``max|Δlogit| / max(1, max|logit|)`` over positions 0..3 of a float32 forward of ``[1, 8]`` random
    tokens, no cache. Encoder-decoder models return 0: their decoder is causal by construction.
    """
    import torch

    if zm.is_encoder_decoder:
        return 0.0
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, zm.vocab_size, (1, 8), generator=gen)
    other = ids.clone()
    other[0, 4:] = 3 + (ids[0, 4:] - 3 + 1) % (zm.vocab_size - 3)
    device = next(zm.model.parameters()).device
    with torch.no_grad():
        a = zm.model(input_ids=ids.to(device), use_cache=False).logits[:, :4].float()
        b = zm.model(input_ids=other.to(device), use_cache=False).logits[:, :4].float()
    return float((a - b).abs().max() / max(1.0, float(a.abs().max())))


CAUSALITY_TOLERANCE = 1e-4
"""Relative logit change of earlier positions (``causality_gap``) above which a checkpoint is refused as not
causal; float32 rounding of a causal model is ~1e-7."""


def _refuse_unusable_checkpoint(session, info) -> None:
    """Load a checkpoint folder (the session keeps it for the items) and check it is a causal language model.

    Raises:
        UsageError: it cannot be loaded, or changing its last input token changes the logits of earlier positions
            (a bidirectional encoder), or its layer types include one kvconform's ReferenceCache does not model
            (``sweep.reference_gap``): a usage error naming the folder and the reason.
    """
    try:
        zm = session.zoo_model(info, "float32")
    except Exception as exc:  # noqa: BLE001 - any loading failure is the user's input problem
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UsageError(f"--kvconform-model {info.spec!r}: loading it failed: {type(exc).__name__}: {first}") from None
    gap = causality_gap(zm)
    if not gap <= CAUSALITY_TOLERANCE:
        raise UsageError(
            f"--kvconform-model {info.spec!r}: not a causal language model: changing later input tokens changed "
            f"the logits of earlier positions by {gap:.2g} (relative; a causal model: 0). A bidirectional encoder "
            f"({zm.config.model_type}) keeps no KV cache between decode steps; kvconform needs a decoder-only or "
            f"encoder-decoder language model")
    from kvconform import sweep

    refused = sweep.reference_gap(zm.config)
    if refused:
        raise UsageError(f"--kvconform-model {info.spec!r}: refused: {refused}")


def run_selftest(session: KVSession, faulty) -> dict:
    """Run a bundled faulty cache (``kvconform.testing.FaultyCache``) through its target check on its model.

    Returns ``{"name", "family", "check", "caught", "items", "failed", "message"}``; ``caught`` is True when at
    least one item of the target check failed with the fault attributed to the subject (not to the model).
    """
    from kvconform.checks import ConformanceError

    sub = build_session(caches=[faulty.spec], models=[faulty.model], builtin=False, checks=[faulty.check],
                        strict=True, device=session.device, full=session.full)
    failed, first = 0, ""
    items = [i for i in sub.items() if not i.skip]
    for item in items:
        try:
            sub.run(item)
        except ConformanceError as exc:
            if not exc.metrics.get("model_at_fault"):
                failed += 1
                first = first or str(exc)
    return {"name": faulty.name, "family": faulty.family, "check": faulty.check, "caught": failed > 0,
            "items": len(items), "failed": failed, "message": first}


def _subject_exception(exc: BaseException) -> BaseException | None:
    """The exception the subject raised behind a ``ConformanceError`` ``exc``, found on the chain of ``__cause__`` /
    ``__context__``: a ``SubjectRaised``'s ``cause``, or the first exception that is not kvconform's own (a check
    that fails while handling the subject's refusal); None when the failure was no raise."""
    from kvconform.outcomes import KVConformError

    seen = 0
    current = exc.__cause__ or exc.__context__
    while current is not None and seen < 8:
        cause = getattr(current, "cause", None)
        if isinstance(cause, BaseException):
            return cause
        if not isinstance(current, KVConformError):
            return current
        current, seen = current.__cause__ or current.__context__, seen + 1
    return None


def _cause_id(exc) -> str | None:
    """The id of the likely cause in a failure's record (``ConformanceError.failure``), or None."""
    cause = getattr(getattr(exc, "failure", None), "cause", None)
    return getattr(cause, "id", None)
