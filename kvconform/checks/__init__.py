"""Checks: plain functions ``check_<property>(ctx) -> None`` that raise ``ConformanceError``.

Checks do not depend on pytest: the suite, ``check_cache`` and ``parametrize_with_checks`` all call them through
``run_check``. Each check is registered with its family (the matrix column) and the capabilities it needs.
"""

from __future__ import annotations

import traceback
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from kvconform.families import FAMILIES  # noqa: F401 - the one family list (matrix order), re-exported
from kvconform.memo import MEMO
from kvconform.outcomes import CheckSkipped, KVConformError  # noqa: F401 - re-exported: the suite catches it here
from kvconform.outcomes import REPORT_TO, KVConformInternalError, own_fault  # noqa: F401 - re-exported
from kvconform.subjects.kinds import (ALL_KINDS, DEFAULT_JUDGES, EVICTING, EXACT, FRESH_KINDS,  # noqa: F401 - for
                                      LOSSY_FRESH, LOSSY_KINDS, LOSSY_TWIN,  # @register(judges=...) in the
                                      check_judges)  # family modules
from kvconform.checks._registry import (BATCH_OPS, CHECKS, IGNORES_OPS, OP_PARAMS,  # noqa: F401 - the registry,
                                        TOKEN_OPS, CheckInfo, Measured, OpRule, Param, load_checks,  # re-exported
                                        register)
from kvconform.digest import reproduce_line as digest_reproduce_line
from kvconform.failure import Cause, OpsTrail
from kvconform.run_options import RunOptions

if TYPE_CHECKING:  # the types of CheckContext's fields, without importing torch-heavy modules at run time
    from kvconform.cases import Case
    from kvconform.oracle import Oracle
    from kvconform.subjects import CacheSpec, Kind
    from torch import Tensor

    from kvconform.zoo import ZooModel


class ConformanceError(AssertionError, KVConformError):
    """A subject does not conform. ``str(err)`` is the failure message (format: ARCHITECTURE.md, "Failure
    messages"); ``metrics`` is JSON-serialisable
    (``max_abs`` logits units, ``tolerance``, ``noise_floor``, ...)."""

    def __init__(self, message: str, metrics: dict | None = None, failure=None):
        super().__init__(message)
        self.metrics = metrics or {}
        self.failure = failure  # the typed record (kvconform.failure.Failure) where a check built one, else None


class Unexcused(KVConformError):
    """A non-conforming item that no expected failure may excuse. Deliberately *not* an ``AssertionError``, so that
    the xfail of a known fault (``raises=AssertionError``) does not apply: the item fails. ``str(err)`` is the
    message; ``metrics`` and ``failure`` as in ``ConformanceError``."""

    def __init__(self, message: str, metrics: dict | None = None, failure=None):
        super().__init__(message)
        self.metrics = metrics or {}
        self.failure = failure


class KnownFaultShown(KVConformError):
    """A failure that shows a known upstream fault's ``evidence`` (``known_faults.toml``): the suite reports the
    item as xfailed with ``str(err)`` (the fault's reason), as for a fault known before the run."""

    def __init__(self, reason: str, metrics: dict | None = None):
        super().__init__(reason)
        self.metrics = metrics or {}


class SubjectNotBuilt(Unexcused):
    """The subject's cache could not be built for this item's model. Deliberately *not* an ``AssertionError``: an
    item whose cache was never built has not shown any fault, known or not, so the xfail of a known upstream fault
    (``raises=AssertionError``) never applies to it — it fails."""



@dataclass
class CheckContext:
    """Everything one item needs.

    Attributes:
        subject: the ``CacheSpec`` under test.
        model: the ``ZooModel`` at the case dtype.
        case: the ``Case``.
        oracle: the model's ``Oracle`` (memoised float64 logits).
        reference: the ``CacheSpec`` used to tell model faults from cache faults.
        metrics: filled by the check (JSON-serialisable), reported even on success.
        check_name: the running check's name (set by ``run_check``).
        known_fault: the bundled known-upstream-fault reason matching this item, if any (named in the message).
        options: the run's ``RunOptions`` (``KVSession.options``): ``full`` (checks may then use their heavier
            profile), ``fuzz_seed`` (mixed into the fuzz family's fixed seeds), the flags a reproduce line repeats,
            and any flag by its short name (``options.get("foo_bar")``).
        encoder_ids: an encoder-decoder model's encoder input ``[B, S_enc]`` (int64 token ids) of the run a driver
            made last (``_interpreter``, ``_observe``, ``_lossy`` set it); None for a decoder-only model or before
            any run.
        benchmark: the pytest-benchmark fixture for ``speed`` items when the plugin is installed, else None
            (``kvconform.timing`` then times with its own loop).
        measured: what the item measured (``Measured``), filled by the check and the op interpreter, shared by the
            contexts ``replace`` makes; a pass it calls blind fails (``run_check``).
    """

    subject: CacheSpec
    model: ZooModel
    case: Case
    oracle: Oracle
    reference: CacheSpec | None = None
    metrics: dict = field(default_factory=dict)
    check_name: str = ""
    known_fault: str | None = None
    benchmark: Any = None
    options: RunOptions = field(default_factory=RunOptions)
    measured: Measured = field(default_factory=Measured)
    encoder_ids: Tensor | None = None

    @property
    def full(self) -> bool:
        """``options.full``: True under ``--kvconform-full``."""
        return self.options.full

    @property
    def fuzz_seed(self) -> int | None:
        """``options.fuzz_seed``: ``--kvconform-fuzz-seed`` (None: the fixed seeds)."""
        return self.options.fuzz_seed

    @property
    def reproduce_args(self) -> tuple[str, ...]:
        """``options.reproduce_args``: the run's flags a reproduce line repeats."""
        return self.options.reproduce_args

    def tolerance(self):
        from kvconform.oracle import Tolerance, dtype_tolerance

        k, abs_min = dtype_tolerance(self.case.dtype)
        factor = (self.case.tolerance_factor or k) * self.subject.tolerance_factor
        model = self.model
        return Tolerance(factor, self.case.abs_min if self.case.abs_min is not None else abs_min,
                         oracle_drift=_DRIFT.get(id(model), 0.0), drift_source=lambda: oracle_drift(model))

    @property
    def kind(self) -> Kind:
        """The subject's ``Kind`` (``kvconform.subjects.kind_of``): what its steps are compared with, how messages
        name it."""
        from kvconform.subjects import kind_of

        return kind_of(self.subject)

    def replace(self, **changes) -> CheckContext:
        """A shallow copy of this context with ``changes`` (field name → value) applied; everything else is shared
        with this one — ``metrics`` too unless given (``metrics={}`` for a run whose numbers are not the item's).

        Raises:
            TypeError: a name that is no field of ``CheckContext``.
        """
        import copy
        import dataclasses

        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"CheckContext.replace: no field {', '.join(map(repr, unknown))}")
        out = copy.copy(self)
        for name, value in changes.items():
            setattr(out, name, value)
        return out

    @property
    def max_cache_len(self) -> int:
        return max(64, self.case.total_tokens)

    def new_cache(self, spec=None):
        """A fresh cache of ``spec`` (default: the subject) sized for this case (``CacheSpec.build``: a factory
        naming ``model`` gets the item's ``PreTrainedModel``; a ``(cache, context)`` result comes back as the cache,
        its context attached and entered by ``_drive.subject_call`` around each call)."""
        spec = spec or self.subject
        return spec.build(self.model, max_cache_len=self.max_cache_len, batch_size=self.case.batch,
                          encoder_len=self.case.encoder_len)

    def headline(self) -> str:
        from kvconform.oracle import DTYPES

        dtype = DTYPES[self.case.dtype].short
        return (f"{self.check_name} failed: {self.subject.name} on {self.model.name} "
                f"({dtype}, batch {self.case.batch}), case {self.case.id}")

    def reproduce(self) -> str:
        name = self.check_name.removeprefix("check_")
        model = self.model.name if self.model.source == "zoo" else self.model.source
        # the fewest words that select the item: a check name inside the case id (case length_bookkeeping of
        # check_length_bookkeeping) says nothing the case id does not
        words = [self.case.id, self.subject.name] if name in self.case.id else [name, self.case.id,
                                                                                  self.subject.name]
        return reproduce_line(self.subject, model, " and ".join(dict.fromkeys(words)),
                              self.reproduce_args)

    def fail(self, lines, metrics=None, measured=None) -> NoReturn:
        """Raise ``ConformanceError`` with the item's ``Failure`` record (``kvconform.failure``): the headline,
        ``lines`` (plain strings, an ``OpsTrail`` and a ``Cause`` in place; empty strings left out), ``measured``
        (a ``Measured``: the value against its bound, or None) and the reproduce line. The error's text is the
        record rendered (``Failure.render``); its ``failure`` attribute is the record."""
        from kvconform.failure import Failure

        self.metrics.update(metrics or {})
        body = [line for line in lines if line]  # empty strings and None left out, as before
        if getattr(self.model.model, "adapter", None) is not None:  # a from-scratch model: its own terms
            from kvconform.scratch import adapter_lines

            failed_at = None if self.metrics.get("raised") else self.metrics.get("failed_at")
            body = adapter_lines(self.check_name, body, failed_at, bool(self.metrics.get("raised")))
        if self.known_fault:
            short = self.known_fault if len(self.known_fault) <= 220 else self.known_fault[:217] + "..."
            body.append(f"known upstream fault: {short}")
        from kvconform.remote import subject_origin

        origin = subject_origin(self.subject)  # a repository's own cache class: which file and class
        body = [f"subject: {origin}", *body] if origin else body
        failure = Failure(self.headline(), tuple(body), measured, self.reproduce(), tuple(self.reproduce_args))
        raise ConformanceError(failure.render(), dict(self.metrics), failure=failure)


def reproduce_line(subject, model_spec: str, selection: str, options=()) -> str:
    """The ``reproduce:`` line of a failure message for ``subject`` (a ``CacheSpec``): ``digest.reproduce_line``
    with its name and source (the controller of an xdist run, which holds no subjects, calls that directly)."""
    return digest_reproduce_line(getattr(subject, "source", "builtin"), subject.name, model_spec, selection, options)


def _unwrapped_build_error(fn, ctx) -> None:
    """``fn(ctx)``; a ``SubjectRaised`` whose cause is building the subject (a check that makes a fresh cache inside
    its ops and reports any raise there as the subject's) is re-raised as that ``SubjectBuildError``."""
    from kvconform.checks._drive import SubjectRaised
    from kvconform.subjects import SubjectBuildError

    try:
        fn(ctx)
    except SubjectRaised as exc:
        if isinstance(exc.cause, SubjectBuildError):
            raise exc.cause from None
        raise


def run_check(name: str, ctx: CheckContext) -> dict:
    """Run check ``name`` on ``ctx``; return its metrics. Raises ``ConformanceError`` on non-conformance."""
    from kvconform.subjects import FactoryResultError, SubjectBuildError

    info = load_checks()[name]
    ctx.check_name = name
    try:
        _unwrapped_build_error(info.fn, ctx)
    except SubjectBuildError as exc:
        from kvconform.checks._diagnosis import describe_exception

        try:
            wrong_result = isinstance(exc.cause, FactoryResultError)
            factory = ctx.subject.factory
            abstract = sorted(getattr(factory, "__abstractmethods__", ()) or ()) if isinstance(factory, type) else []
            if wrong_result:
                cause = ("likely cause: the factory returns the wrong thing: a transformers.Cache or a pair (cache, "
                         "context manager) is expected")
            elif abstract and isinstance(exc.cause, TypeError):  # Python refuses to instantiate an abstract class
                cls_name = getattr(factory, "__name__", "the cache class")
                cause = (f"likely cause: {cls_name} is abstract: it does not implement "
                         f"{', '.join(abstract)}, declared abstract by a base class; implement "
                         f"{'it' if len(abstract) == 1 else 'them'} in {cls_name}")
            elif (read_only := _read_only_attribute(exc.cause)) is not None:
                cause = (f"likely cause: the constructor assigns self.{read_only}, a read-only property of a base "
                         f"class (transformers' Cache derives {read_only} from its layers): no keyword argument can "
                         f"fix it — keep the value under another name, or let the base class derive it")
            elif isinstance(exc.cause, NotImplementedError):
                cause = "likely cause: " + _not_supported(ctx, exc.cause)
            else:
                cause = ("likely cause: the cache's constructor (or factory) cannot build a cache for this model from "
                         "the keyword arguments kvconform passes (config, max_cache_len, batch_size, device, dtype; "
                         "only those its signature accepts; model where it names it)")
            ctx.fail([f"building the subject failed: {exc.cause}" if wrong_result else
                      f"building the subject raised {describe_exception(exc.cause)}",
                      f"called: {exc.name}({', '.join(f'{k}=...' for k in exc.kwargs)}) for {ctx.model.name}",
                      cause],
                     {"raised": type(exc.cause).__name__, "failed_at": "construction"})
        except ConformanceError as err:
            raise SubjectNotBuilt(str(err), err.metrics, failure=err.failure) from None
    except (ConformanceError, Unexcused) as exc:
        found = _internal_in_chain(exc)
        if found is not None:  # the failure came from a raise of kvconform's own code (its reference, its wrappers)
            raise internal_error(ctx, found) from None
        raise
    except KVConformError as exc:
        from kvconform.checks._drive import SubjectRaised

        if not isinstance(exc, SubjectRaised):
            raise
        if exc.internal is not None:
            raise internal_error(ctx, exc.internal) from None
        from kvconform.checks._diagnosis import fail_raised

        fail_raised(ctx, exc, "the subject raised where the check did not expect it (see the exception above)")
    except Exception as exc:  # noqa: BLE001 - escaped the check: kvconform's gap, or the subject's own code raised
        escaped(ctx, exc)
    record = ctx.measured.as_metrics()
    if record:
        ctx.metrics["measured"] = record
    reason = ctx.measured.blind()
    if reason:  # nothing measured is not a pass (docs/reading-results.md, "Blind items")
        ctx.fail([f"blind: {reason}",
                  "a pass needs a measurement of the cache; this one measured nothing the case says it must",
                  OpsTrail.of_case(ctx.case)], {"blind": reason})
    return ctx.metrics


def run_power(name: str, ctx: CheckContext, mutants) -> dict:
    """The power pass of an item that passed (ARCHITECTURE.md, "Power on the subject's own cache"): re-run check
    ``name`` on the same ``ctx`` (model, case, oracle) with the subject replaced by each of ``mutants``
    (``checks._power.Mutant``: ``_power.mutant_spec``), in process. Returns ``{mutant name: result}``, a result
    being ``_power.KILLED`` (the check failed on it: a ``ConformanceError``, or an ``Unexcused`` failure of the
    subject's own raise), ``SURVIVED`` (it passed: the item cannot see that bug), ``UNUSED`` (the check skipped on
    it, or never made the mutant live: its mutated method was never called) or ``ERROR`` (kvconform's own code
    failed on it, or the mutant could not be made for this cache: no verdict, never a kill). Never raises a mutant's
    failure: the item's outcome is the subject's alone."""
    import torch

    from kvconform.checks._power import ERROR, KILLED, SURVIVED, UNUSED, mutant_spec

    out = {}
    for mutant in mutants:
        spec = mutant_spec(ctx.subject, mutant)
        mctx = ctx.replace(subject=spec, metrics={})
        torch.manual_seed(0)
        try:
            run_check(name, mctx)
            result = SURVIVED
        except (SubjectNotBuilt, KVConformInternalError):
            result = ERROR
        except (ConformanceError, Unexcused):
            result = KILLED
        except CheckSkipped:
            result = UNUSED
        except Exception:  # noqa: BLE001 - anything else is no verdict on the mutant (never the item's)
            result = ERROR
        # a mutant the check never made live (its method never called, no decode step) is no evidence either way
        out[mutant.name] = result if spec.kvconform_touched.count or result == ERROR else UNUSED
    return out


def _read_only_attribute(exc: BaseException) -> str | None:
    """The attribute name of an ``AttributeError`` raised by assigning a property without a setter (Python ≥ 3.11:
    "property 'batch_size' of 'X' object has no setter"; 3.10: "can't set attribute 'batch_size'"), else None."""
    import re

    if not isinstance(exc, AttributeError):
        return None
    m = re.search(r"property '(\w+)' of '[^']*' object has no setter|can't set attribute '(\w+)'", str(exc))
    return (m.group(1) or m.group(2)) if m else None


def _internal_in_chain(exc: BaseException) -> dict | None:
    """Where kvconform's own code raised the exception a failure was made from (the check failed while handling
    it: ``exc``'s context chain), or None: the first ``SubjectRaised`` in the chain gives its ``internal``; a plain
    exception caught by the check around a call on the subject (``generate``, ``crop``...) is read as such a call
    (``own_fault(..., through_subject_call=True)``)."""
    from kvconform.checks._drive import SubjectRaised

    seen, link = 0, exc.__context__
    while link is not None and seen < 8:
        if isinstance(link, SubjectRaised):
            return link.internal
        if not isinstance(link, KVConformError):
            return own_fault(link, through_subject_call=True)
        link, seen = link.__context__, seen + 1
    return None


def versions_line() -> str:
    """``"transformers 5.24.0, torch 2.13.0, kvconform 0.1.0"`` (the installed versions; "?" where unknown)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "?"

    return ", ".join(f"{name} {of(name)}" for name in ("transformers", "torch", "kvconform"))


def internal_error(ctx: CheckContext, fault: dict) -> KVConformInternalError:
    """The item's error when kvconform's own code failed on it (``fault``: ``outcomes.own_fault``): headline
    "kvconform internal error: ...", the place (file:line in function) and the exception, that the item is not a
    verdict on the subject, the installed versions, where to report it, and the reproduce line. Metrics:
    ``kvconform_internal`` (the place), ``raised``, ``internal_error`` (the exception's first line)."""
    from kvconform.oracle import short_dtype

    dtype = short_dtype(ctx.case.dtype)
    model = getattr(ctx.model, "name", "no model")
    lines = [f"kvconform internal error: {ctx.check_name} on {ctx.subject.name} on {model} ({dtype}, batch "
             f"{ctx.case.batch}), case {ctx.case.id}",
             f"  kvconform's own code raised {fault['what']} (at {fault['place']}"
             + (f"; raised in {fault['raised_in']})" if fault.get("raised_in") else ")"),
             f"  not a verdict on {ctx.subject.name}: this item is an error of kvconform, not a failure of the subject",
             f"  {versions_line()}: {REPORT_TO}",
             "  " + ctx.reproduce()]
    return KVConformInternalError("\n".join(lines), {**ctx.metrics, "kvconform_internal": fault["place"],
                                                     "raised": fault["what"].partition(":")[0],
                                                     "internal_error": fault["what"]})


def escaped(ctx: CheckContext, exc: Exception) -> NoReturn:
    """Judge an exception that escaped a check (no kvconform code turned it into a verdict): kvconform's own gap
    (``KVConformInternalError``) unless the subject's own code raised it (``outcomes.own_fault``), which fails the
    item in the usual short form, naming kvconform's function that called into the subject."""
    if getattr(exc, "model_at_fault", False) and ctx.model is not None:
        # a model adapter's uncached forward (the oracle's model) raised: the model's failure, not the cache's
        ctx.fail([f"kvconform's oracle failed, not the cache: {exc}",
                  f"ops: {ctx.case.ops_label()}",
                  "likely cause: the model, not the cache: kvconform's oracle (forward_uncached, no cache) fails on "
                  "this sequence, so no cache can be judged on it — fix the model (a table or limit shorter than "
                  "the case's tokens: declare max_positions), or scope the cases"],
                 {"raised": type(getattr(exc, "__cause__", None) or exc).__name__, "model_at_fault": True})
    fault = own_fault(exc)
    if fault is not None and ctx.model is None:  # a check called with no model (a direct unit call): its own error
        raise exc
    if fault is not None:
        raise internal_error(ctx, fault) from None
    from kvconform.checks._diagnosis import describe_exception

    tb = traceback.extract_tb(exc.__traceback__)
    caller = next((f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in reversed(tb)
                   if "/kvconform/" in f.filename.replace("\\", "/") and "/kvconform/testing/" not in f.filename), None)
    ctx.fail([f"the subject raised {describe_exception(exc)}"
              + (f" when kvconform's {caller} read or called it" if caller else ""),
              OpsTrail.of_case(ctx.case),
              Cause("the cache's own code raised on a call or attribute read a caller may make (a method or "
                    "property of the Cache API must answer, or refuse with a clear error, never crash)",
                    "cache_code_raised")],
             {"raised": type(exc).__name__})


def _not_supported(ctx, exc) -> str:
    """The cause line of a subject whose construction raised ``NotImplementedError`` (``exc``) on ``ctx.model``:
    the cache does not support this model — naming the model's layer types its message names (else all of them) —
    and the declaration that scopes it (``kvconform_supports``)."""
    text = str(exc).lower()
    model = ctx.model
    types = sorted(set(getattr(model, "layer_types", ()) or ()))
    named = [t for t in types if t.lower() in text or t.split("_")[0].lower() in text]
    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or "")
    shown = named or types
    what = f"{model.name}'s {', '.join(shown)} layers" if shown else model.name
    if not named and model_type and model_type.lower() in text:
        what = f"{model.name} ({model_type})"
    supported = sorted({"full_attention", "sliding_attention"} - set(shown)) or ["full_attention"]
    from kvconform.subjects.spec import SUPPORT_POSITIONS, model_positions

    positions = model_positions(model)
    words = {"rotary_positions": ("rotary", "rope"), "alibi_positions": ("alibi",),
             "learned_positions": ("learned", "position embedding", "wpe", "absolute"),
             "relative_positions": ("relative",)}
    # a message naming how positions are encoded (a cache for rotary models only), or no layer type named on a
    # model whose position encoding is known: the position declaration fits, not a layer type
    named_kinds = [k for k, ws in words.items() if any(w in text for w in ws)]
    if named_kinds or (not named and positions and "position" in text):
        served = [k for k in named_kinds if k != positions] or [k for k in SUPPORT_POSITIONS if k != positions]
        supported = served[:1] if named_kinds else served
        what = f"{model.name} ({(positions or 'its position encoding').replace('_', ' ')})"
    supported = sorted(set(ctx.subject.supports or ()) | set(supported))  # keep what it declares
    return (f"{ctx.subject.name} does not support {what} (its construction raised NotImplementedError, which is "
            f"how a cache says so; no keyword argument would change it): scope the cache to what it supports — "
            f"kvconform_supports = {{{', '.join(repr(n) for n in supported)}}} (layer types, model kinds and "
            f"position encodings; "
            f"CacheSpec(supports=...)) — and these items are skipped with that reason")


_DRIFT = MEMO.table("checks.oracle_drift")
DRIFT_PROGRAM = (12, 10)
"""The program that measures a float32-bound oracle's drift: prefill 12 tokens, then decode 10 one at a time."""


def oracle_drift(zm) -> float:
    """What the float64 oracle of ``zm`` (a ``ZooModel``) cannot resolve between a cached and an uncached forward,
    in logit units; 0.0 for a model whose float64 forward is float64 throughout (every zoo model but Mamba2-style
    ones measured so far) and for encoder-decoder models.

    A model whose code casts to float32 inside (its float64 forward returns float32 logits: NemotronH, whose Mamba2
    mixer, norms, router and ``lm_head(...).float()`` run in float32) has a float32 oracle: its single-token decode
    and its full-sequence scan round differently, so even kvconform's ``ReferenceCache`` at float64 differs from the
    uncached forward (NemotronH: 1.7e-5 after 10 decode steps, growing smoothly step by step). For such a model
    this is the largest ``|ReferenceCache − oracle|`` over ``DRIFT_PROGRAM`` in float64, measured once per model
    and run, and only when a step needs it (``Tolerance.drift_source``: Mamba2's float64 forward takes 2.6 s); the
    tolerance treats it as a noise floor (``Tolerance.oracle_drift``). A drift above ``oracle.DRIFT_MAX`` is not
    rounding: it is left to the checks to report (0.0 is returned).
    """
    import torch

    if zm.is_encoder_decoder:
        return 0.0
    key = id(zm)
    if key not in _DRIFT:
        _DRIFT[key] = _measure_drift(zm, torch)
        # forgotten with the model: a later ZooModel may get the same id (a test that loaded NemotronH, then llama,
        # was given NemotronH's 2.4e-5 for llama, whose drift is 0)
        weakref.finalize(zm, _DRIFT.pop, key, None)
    return _DRIFT[key]


def _measure_drift(zm, torch) -> float:
    from kvconform.compat import cache_kwarg
    from kvconform.oracle import DRIFT_MAX
    from kvconform.reference import ReferenceCache

    model = zm.oracle_model()
    prefill, decodes = DRIFT_PROGRAM
    ids = (torch.arange(prefill + decodes) * 7 + 3).remainder(zm.vocab_size).unsqueeze(0)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False).logits
            if out.dtype == torch.float64:
                return 0.0
            cache, name = ReferenceCache(model.config), cache_kwarg(model)
            steps = [model(input_ids=ids[:, :prefill], use_cache=True, **{name: cache}).logits]
            for i in range(prefill, prefill + decodes):
                steps.append(model(input_ids=ids[:, i:i + 1], position_ids=torch.tensor([[i]]), use_cache=True,
                                   **{name: cache}).logits)
    except Exception:  # noqa: BLE001 - no drift measured: the checks judge this model at the default floor
        return 0.0
    drift = float((torch.cat(steps, 1).double() - out.double()).abs().max())
    return drift if drift <= DRIFT_MAX else 0.0
