"""The plan of a kvconform run (subjects × models × cases) and the per-process state that runs it.

Built once per process in ``pytest_configure`` (xdist workers build their own, identically: everything is sorted
and ids contain no addresses). Models and oracles are built lazily, once per (model, dtype).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

from kvconform import zoo


@dataclass(frozen=True)
class ModelInfo:
    """What collection needs to know about a model without building its weights."""

    name: str
    spec: str
    layer_types: tuple
    is_encoder_decoder: bool
    accepts_position_ids: bool

    @property
    def features(self) -> set:
        from kvconform.zoo import ZooModel

        probe = ZooModel(self.name, None, None, None, self.is_encoder_decoder, self.layer_types, None)
        feats = {"encoder_decoder" if self.is_encoder_decoder else "decoder_only"}
        if probe.has_attention:
            feats.add("attention")
        if probe.has_sliding:
            feats.add("sliding")
        if probe.has_linear_attention:
            feats.add("linear_attention")
        return feats


def model_info(spec: str) -> ModelInfo:
    """Inspect a zoo name or checkpoint folder (config only).

    Raises:
        ValueError: neither a zoo name nor a folder with a config.json (names the spec and what is allowed).
    """
    import os

    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if not zoo.is_checkpoint_spec(spec):
        if os.path.isfile(os.path.join(spec, "config.json")):
            raise ValueError(f"--kvconform-model {spec!r}: both a zoo family and a checkpoint folder here; "
                             f"write ./{spec} for the folder")
        config, name = zoo.zoo_config(spec), spec
    else:
        path = os.path.expanduser(spec)
        problem = zoo.checkpoint_problem(path)
        if problem == "no such folder" and os.sep not in spec and "/" not in spec:
            problem = f"not a zoo name ({', '.join(zoo.ZOO_NAMES)}) and not a checkpoint folder"
        if problem:
            raise ValueError(f"--kvconform-model {spec!r}: {problem}")
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"--kvconform-model {spec!r}: cannot read its config.json: {first}") from None
        name = zoo.checkpoint_name(path)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    try:
        cls = auto._model_mapping[type(config)]
        import inspect

        accepts = "position_ids" in inspect.signature(cls.forward).parameters
    except Exception:  # noqa: BLE001 - unknown architecture: decided at run time
        accepts = True
    types, _ = zoo._layer_types(config)
    return ModelInfo(name, spec, types, bool(config.is_encoder_decoder), accepts)


@dataclass(frozen=True)
class PlanItem:
    """One item: subject × model × check × case, with the reason it is skipped or expected to fail."""

    subject: object
    model: ModelInfo
    check: object
    case: object
    skip: str | None = None
    xfail: str | None = None

    @property
    def id(self) -> str:
        return f"{self.subject.name}-{self.model.name}-{self.check.name.removeprefix('check_')}-{self.case.id}"

    def marks(self, pytest):
        marks = [pytest.mark.kvconform, getattr(pytest.mark, f"kvconform_{self.check.family}")]
        if self.skip:
            marks.append(pytest.mark.skip(reason=self.skip))
        elif self.xfail:
            marks.append(pytest.mark.xfail(reason=self.xfail, strict=False, raises=AssertionError))
        return marks

    def describe(self) -> dict:
        return {"subject": self.subject.name, "model": self.model.name, "check": self.check.name,
                "family": self.check.family, "case": self.case.id}


def in_scope(subject, model: ModelInfo, case, full: bool = True) -> bool:
    """Whether the item exists at all. A case limited to some models (``models``) or model features
    (``requires``), and a subject that cannot serve a model (``CacheSpec.applies_to``, e.g. QuantizedCache on a
    model with linear-attention layers), generate no item there — listing thousands of such skips would bury the
    ones that say something (a capability the subject lacks, missing hardware, a full-tier case)."""
    from kvconform.cases import model_requirements_unmet

    if (case.tier == "full" or subject.tier == "full") and not full:
        return False  # opt-in tier: counted in the report header instead of listed as skips
    if case.models and model.name not in case.models:
        return False
    if model_requirements_unmet(case, model.features):
        return False
    return subject.applies_to is None or subject.applies_to(model) is None


def skip_reason(subject, model: ModelInfo, check, case, full: bool = False, device: str = "cpu") -> str | None:
    """The one place that decides whether an item applies (DESIGN §4.1).

    Besides capabilities and model features: a check may declare its own rule as
    ``fn.kvconform_applies(subject, model, case, device=...) -> reason or None`` (lossy-only checks, coverage checks
    tied to one subject); a lossy subject (``CacheSpec.twin``) is not held to the generate family's token-for-token
    comparison with the exact model; ``CacheSpec.requires`` and ``CacheSpec.needs_cuda`` gate optional backends and
    hardware.
    """
    from kvconform.cases import model_requirements_unmet
    from kvconform.compat import missing_requirement

    if case.tier == "full" and not full:
        return f"case {case.id} is in the full tier (opt-in: --kvconform-full)"
    missing = sorted(check.needs - subject.capabilities)
    if missing:
        note = getattr(subject, "notes", {}).get(missing[0])
        return f"{subject.name} does not declare capability '{missing[0]}'" + (f": {note}" if note else "")
    own_rule = getattr(check.fn, "kvconform_applies", None)
    reason = own_rule(subject, model, case, device=device) if own_rule is not None else None
    if reason:
        return reason
    if getattr(subject, "twin", None) is not None and check.family == "generate" and own_rule is None:
        return (f"{subject.name} is lossy: its greedy generate() is compared with its fake-quant twin "
                f"(check_generate_vs_twin), not token for token with the exact model")
    for requirement, hint in getattr(subject, "requires", {}).items():
        if missing_requirement(requirement):
            return f"requires {requirement} ({hint})"
    if getattr(subject, "needs_cuda", None) and not _cuda_device(device):
        return subject.needs_cuda
    unmet = model_requirements_unmet(case, model.features)
    if unmet:
        return unmet
    if case.position_ids == "explicit" and not model.accepts_position_ids and check.family == "logits":
        return f"{model.name}'s forward takes no position_ids"
    if subject.applies_to is not None:
        return subject.applies_to(model)
    return None


def _cuda_device(device: str) -> bool:
    import torch

    return str(device).startswith("cuda") and torch.cuda.is_available()


@dataclass
class KVSession:
    """Per-process state: the resolved subjects, models, cases, known faults and the built models."""

    subjects: list
    models: list
    cases: list
    checks: dict
    strict: bool
    device: str
    faults: list
    full: bool = False
    _built: dict = field(default_factory=dict)
    _oracles: dict = field(default_factory=dict)

    def items(self) -> list[PlanItem]:
        out = []
        for case in self.cases:
            check = self.checks[case.check]
            for subject in self.subjects:
                for model in self.models:
                    if not in_scope(subject, model, case, self.full):
                        continue
                    skip = skip_reason(subject, model, check, case, self.full, self.device)
                    xfail = (subject.expected_failures.get(f"{check.name}:{case.id}")
                             or subject.expected_failures.get(check.name))
                    item = PlanItem(subject, model, check, case, skip, xfail)
                    if not xfail and not self.strict:
                        item = PlanItem(subject, model, check, case, skip, self.known_fault(item))
                    out.append(item)
        return out

    @property
    def reference(self):
        return next(s for s in self.subjects if s.name == "ReferenceCache") if any(
            s.name == "ReferenceCache" for s in self.subjects) else _reference_spec()

    def zoo_model(self, model: ModelInfo, dtype_name: str):
        import torch

        key = (model.spec, dtype_name)
        if key not in self._built:
            self._built[key] = zoo.load_model(model.spec, dtype=getattr(torch, dtype_name), device=self.device)
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

        from kvconform.checks import CheckContext, run_check

        torch.manual_seed(0)
        zm = self.zoo_model(item.model, item.case.dtype)
        ctx = CheckContext(item.subject, zm, item.case, self.oracle(zm), reference=self.reference,
                           known_fault=self.known_fault(item), full=self.full, benchmark=benchmark)
        return run_check(item.check.name, ctx)

    def known_fault(self, item: PlanItem) -> str | None:
        """The bundled known-fault reason for ``item`` on the installed transformers (strict or not)."""
        from kvconform import known_faults
        from kvconform.compat import transformers_version

        return known_faults.match(self.faults, transformers_version(), item.subject.name, item.model.name,
                                  item.check.name, item.case.id)

    def environment(self) -> dict:
        import torch
        import transformers

        import kvconform

        return {"kvconform": kvconform.__version__, "python": platform.python_version(),
                "torch": torch.__version__, "transformers": transformers.__version__,
                "platform": platform.platform(), "device": self.device,
                "cuda_available": bool(torch.cuda.is_available()), "strict": self.strict}

    def header_lines(self) -> list[str]:
        env = self.environment()
        return [
            f"kvconform {env['kvconform']}: transformers {env['transformers']}, torch {env['torch']}, "
            f"device {self.device}, known faults {'fail (strict)' if self.strict else 'xfail'}",
            f"kvconform subjects: {', '.join(s.name for s in self.subjects)}",
            f"kvconform models: {', '.join(m.name for m in self.models)}; cases: {len(self.cases)}"
            + ("" if self.full else f" ({sum(c.tier == 'full' for c in self.cases)} in the full tier, not run: "
                                    f"add --kvconform-full)"),
        ]


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
    from transformers.utils import logging

    logging.set_verbosity_error()


def build_session(caches=(), models=(), case_paths=(), strict=False, device="cpu", full=False,
                  builtin=True, checks=None, case_ids=None) -> KVSession:
    """Resolve everything the user passed into a ``KVSession``.

    Args:
        caches: extra subjects — ``"module:attr"`` strings, ``CacheSpec`` objects, Cache subclasses or factories.
        models: zoo names / checkpoint folders (default: the whole zoo).
        case_paths: extra case files or folders.
        builtin: include the built-in subjects (ReferenceCache, DynamicCache, StaticCache, ...).
        checks: if given, only cases running these check names.
        case_ids: if given, only these case ids.

    Raises:
        ValueError (``SpecError``, ``CaseFileError``): bad input, naming the spec / file and the cause.
    """
    from kvconform.cases import load_cases
    from kvconform.checks import load_checks
    from kvconform.known_faults import load_known_faults
    from kvconform.subjects import as_cache_spec, builtin_subjects, check_factory_builds_cache

    _quiet_transformers()
    _limit_threads()
    registry = load_checks()
    subjects = builtin_subjects() if builtin else []
    for obj in caches or ():
        subject = as_cache_spec(obj)
        check_factory_builds_cache(subject, zoo.zoo_config("llama"))
        if any(s.name == subject.name for s in subjects):
            raise ValueError(f"--kvconform-cache {obj!r}: a subject named {subject.name!r} already exists")
        subjects.append(subject)
    infos = [model_info(m) for m in (models or zoo.ZOO_NAMES)]
    names = [i.name for i in infos]
    if len(set(names)) != len(names):
        raise ValueError(f"--kvconform-model: duplicate model names {names}")
    cases = load_cases(case_paths, known_checks=set(registry))
    for name in checks or ():
        if name not in registry:
            raise ValueError(f"unknown check {name!r}; known: {', '.join(sorted(registry))}")
    if checks:
        cases = [c for c in cases if c.check in set(checks)]
    if case_ids:
        unknown = set(case_ids) - {c.id for c in cases}
        if unknown:
            raise ValueError(f"unknown case id(s) {sorted(unknown)}")
        cases = [c for c in cases if c.id in set(case_ids)]
    return KVSession(subjects, infos, cases, registry, strict, device, load_known_faults(), full)


class ItemTimeout(BaseException):
    """Raised inside an item that ran past ``--kvconform-timeout`` (converted to a ConformanceError). A
    BaseException, so that the checks' ``except Exception`` around subject calls does not swallow it."""


def item_timeout(seconds: float, item: PlanItem):
    """Context manager failing ``item`` with a ConformanceError after ``seconds`` (POSIX main thread only; a hang
    inside one native call is interrupted when it returns to Python). ``seconds <= 0`` disables it."""
    import contextlib
    import signal
    import threading

    @contextlib.contextmanager
    def guard():
        usable = seconds > 0 and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        if not usable:
            yield
            return

        def on_alarm(signum, frame):
            raise ItemTimeout()

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        except ItemTimeout:
            from kvconform.checks import ConformanceError, reproduce_line

            d = item.describe()
            raise ConformanceError(
                f"{d['check']} failed: {d['subject']} on {d['model']}, case {d['case']}\n"
                f"  no result after {seconds:g} s (per-item timeout, --kvconform-timeout)\n"
                f"  likely cause: the subject hangs (an endless loop, a lock) or is pathologically slow\n"
                f"  {reproduce_line(item.subject, item.model.spec, item.id)}", {"timeout_s": seconds}) from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    return guard()


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
