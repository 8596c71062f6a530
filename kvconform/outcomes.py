"""The root of kvconform's exceptions, and the outcome exceptions raised below the checks layer.

Every exception kvconform raises on purpose derives from ``KVConformError`` (``except KVConformError`` catches them
all), each keeping the base its callers rely on:

* usage errors (``UsageError``; the run stops with exit code 4): ``subjects.SpecError``, ``cases.CaseFileError``,
  ``known_faults.KnownFaultsError`` — also ``ValueError`` s;
* conformance failures: ``checks.ConformanceError`` (also an ``AssertionError``, so pytest and the xfail of a known
  fault treat it as a test failure), ``checks.Unexcused`` and ``checks.SubjectNotBuilt`` (deliberately *not*
  ``AssertionError`` s: no xfail excuses them), ``checks.KnownFaultShown``;
* skips: ``CheckSkipped``;
* a subject's own faults, reported on its items: ``subjects.SubjectBuildError``, ``subjects.FactoryResultError``
  (also a ``TypeError``), ``subjects.ModelLeftChanged`` (also a ``RuntimeError``), ``checks._drive.SubjectRaised``;
* control flow inside a check: ``checks.fuzz.ProgramFailed``, ``checks._interpreter.StopRun``;
* kvconform's own refusals and notes: ``merge.MergeError`` (a ``UsageError`` and a ``ValueError``: reports that do
  not merge), ``report.ReportLocked`` (another run holds the JSON report), ``vision.PartialImage`` (also a
  ``ValueError``: a sequence cut inside its image block), ``architectures.ImageProbeFailed`` and
  ``architectures.TooLarge`` (also ``RuntimeError`` s: an architecture kvconform cannot build tiny),
  ``checks.crop.PositiveCropNote`` (also a ``UserWarning``: what ``crop(+N)`` did, reported as a note).

One exception stays outside: ``workers.ItemTimeout`` is a ``BaseException`` so that no ``except Exception`` around a
subject call swallows the per-item timeout.

Bottom of the import layers (see ARCHITECTURE.md and ``[tool.importlinter]`` in pyproject.toml): it imports
nothing, so ``timing`` (which raises ``CheckSkipped`` when benchmarking is disabled) need not import ``checks``.
``kvconform.checks`` re-exports ``CheckSkipped``; the suite and ``run_check`` catch it from there.
"""

from __future__ import annotations


class KVConformError(Exception):
    """The root of every exception kvconform raises on purpose (see the module docstring)."""


class UsageError(KVConformError):
    """Bad input from the user (a spec, a case file, a known-faults file): the run stops with exit code 4 and
    ``str(err)`` names the input and the fix."""


class CheckSkipped(KVConformError):
    """A check found at run time that it cannot measure here (e.g. benchmarking is disabled). The suite reports
    the item as skipped with ``str(err)`` as the reason — never as passed."""


def with_article(word: str) -> str:
    """``word`` with its indefinite article, for messages naming a type: ``"an int"``, ``"a str"``, ``"an
    OffloadedCache"`` (by the first letter: a vowel takes "an")."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


# ------------------------------------------------------------------------------------------------ breadcrumbs
# Where a process is: the item it runs and the last op it started, kept in a small file that outlives the process.
# A subject that kills its process (a segfault or abort in a native kernel, os._exit, the OOM killer's SIGKILL) leaves
# no Python traceback; the pytest-xdist controller reads the crashed worker's file to name the item's last op
# (kvconform.plugin, "crashes"). One pwrite of a fixed-size record per op: nothing is lost when the process dies
# right after, since the kernel holds the data.
_BREADCRUMB = {"fd": None}
BREADCRUMB_SIZE = 1024


def open_breadcrumbs(path: str) -> None:
    """Record this process's breadcrumbs in ``path`` (created, or truncated)."""
    import os

    close_breadcrumbs()
    _BREADCRUMB["fd"] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)


def close_breadcrumbs() -> None:
    import os

    fd, _BREADCRUMB["fd"] = _BREADCRUMB["fd"], None
    if fd is not None:
        os.close(fd)


def breadcrumb(op: str, item: str | None = None) -> None:
    """Record ``op`` (``"decode 6"``, ``"generate(max_new_tokens=12)"``) as the last op started, and ``item`` (an
    item id) when a new item starts. A no-op unless ``open_breadcrumbs`` was called in this process."""
    import os

    fd = _BREADCRUMB["fd"]
    if fd is None:
        return
    if item is not None:
        _BREADCRUMB["item"] = item
    text = f"{_BREADCRUMB.get('item', '')}\n{op}".encode("utf-8", "replace")[:BREADCRUMB_SIZE]
    os.pwrite(fd, text.ljust(BREADCRUMB_SIZE, b"\0"), 0)


def read_breadcrumbs(path: str) -> tuple[str, str] | None:
    """``(item id, last op started)`` recorded in ``path``, or None when there is none."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(BREADCRUMB_SIZE).rstrip(b"\0").decode("utf-8", "replace")
    except OSError:
        return None
    if not data:
        return None
    item, _, op = data.partition("\n")
    return item, op


# ------------------------------------------------------------------------------------------------ kvconform's own gaps
# An exception raised inside kvconform's own code (its reference cache, oracle, evidence or diagnosis code) is not a
# verdict on the subject: the item is an error of kvconform ("kvconform internal error"), reported with the place and
# where to report it, and the run's summary lists such gaps once ("kvconform's own gaps"). Which code an exception
# passed through is read from its traceback, frame by frame, by the module each frame runs (``frame_owner``).
REPORT_TO = ("report it to kvconform's maintainers (its issue tracker), with this message and the versions above — "
             "not to the subject's authors")
"""Where a kvconform internal error is to be reported (the last line of its message and of the run's summary)."""

LIBRARY_PACKAGES = frozenset({
    "transformers", "torch", "torchvision", "functorch", "triton", "numpy", "safetensors", "huggingface_hub",
    "tokenizers", "accelerate", "optimum", "hqq", "kernels", "mamba_ssm", "causal_conv1d", "einops", "sympy",
    "typing_extensions", "packaging", "filelock", "fsspec", "regex", "_pytest", "pytest", "pluggy", "xdist",
    "execnet", "hypothesis", "pytest_benchmark", "pytest_randomly"})
"""Top-level packages whose frames are neither kvconform's nor a subject's: the libraries every run uses (a built-in
subject's code is transformers' own; the standard library counts too). Any other code is the subject's (a user's
cache module, a package from the registry, a model repository's own code, kvconform's bundled faulty caches)."""

_REFERENCE_MODULE = "kvconform.reference"


class KVConformInternalError(KVConformError):
    """kvconform's own code failed on an item (not the subject's): ``str(err)`` is the message ("kvconform internal
    error: ...", the place, the versions, where to report it); ``metrics`` carries ``kvconform_internal`` (the place,
    ``file:line in function``), ``raised`` (the exception type) and ``internal_error`` (its first line). Deliberately
    not an ``AssertionError``: no known fault's xfail excuses it. The reports give such an item the outcome
    ``internal`` and the run's exit code is 3 (``plugin``)."""

    def __init__(self, message: str, metrics: dict | None = None):
        super().__init__(message)
        self.metrics = metrics or {}


def frame_owner(frame) -> str:
    """Whose code a Python frame runs: ``"kvconform"`` (kvconform's own modules, ``kvconform.testing``'s bundled
    faulty caches excepted; a frame of a transformers method that kvconform's reference cache inherits, run on a
    reference object, counts as kvconform's), ``"library"`` (``LIBRARY_PACKAGES``, the standard library, generated
    code) or ``"subject"`` (anything else). A frame of ``kvconform.reference`` run on an object of another module's
    class (a user's subclass of ``ReferenceCache``) is the subject's: the subject inherits that code."""
    import sys

    module = str(frame.f_globals.get("__name__") or "")
    top = module.partition(".")[0]
    try:
        this = frame.f_locals.get("self")
    except Exception:  # noqa: BLE001 - a frame whose locals cannot be read
        this = None
    of_reference = this is not None and type(this).__module__ == _REFERENCE_MODULE
    if module == _REFERENCE_MODULE:
        return "kvconform" if this is None or of_reference else "subject"
    if top == "kvconform":
        return "subject" if module.startswith("kvconform.testing") else "kvconform"
    if top in LIBRARY_PACKAGES or top in sys.stdlib_module_names or not module or frame.f_code.co_filename[:1] == "<":
        return "kvconform" if of_reference else "library"
    return "subject"


_REFUSED_CALL = ("got an unexpected keyword argument", "required positional argument", "required keyword-only",
                 "positional argument but", "positional arguments but", "got multiple values for argument")


def refused_callee_owner(exc: BaseException, frame) -> str | None:
    """Whose function refused a call made in ``frame`` by its signature (a ``TypeError`` such as ``"Cache.update()
    got an unexpected keyword argument 'kwargs'"``, raised in the caller's frame before the callee runs): the
    ``frame_owner``-style owner (``"kvconform"``, ``"library"``, ``"subject"``) of the callee found among the frame's
    local values (a function, or a method of a local object's class, of that qualified name), or None when ``exc`` is
    no such refusal or the callee is not found."""
    import re
    import sys

    if not isinstance(exc, TypeError) or not any(w in str(exc) for w in _REFUSED_CALL):
        return None
    m = re.match(r"([\w.<>]+)\(\)", str(exc))
    if not m:
        return None
    qualname = m.group(1)
    method = qualname.rsplit(".", 1)[-1]
    try:
        values = list(frame.f_locals.values())
    except Exception:  # noqa: BLE001
        return None
    for value in values:
        for candidate in (value, getattr(type(value), method, None)):
            fn = getattr(candidate, "__func__", candidate)
            if getattr(fn, "__qualname__", None) != qualname:
                continue
            module = str(getattr(fn, "__module__", "") or "")
            top = module.partition(".")[0]
            if top == "kvconform":
                return "subject" if module.startswith("kvconform.testing") else "kvconform"
            return "library" if top in LIBRARY_PACKAGES or top in sys.stdlib_module_names else "subject"
    return None


def _reference_frame(frame) -> bool:
    """A frame of ``kvconform.reference`` or of a method running on an object of one of its classes."""
    if frame.f_globals.get("__name__") == _REFERENCE_MODULE:
        return True
    try:
        this = frame.f_locals.get("self")
    except Exception:  # noqa: BLE001
        return False
    return this is not None and type(this).__module__ == _REFERENCE_MODULE


def _frames(exc: BaseException) -> list:
    out, tb = [], exc.__traceback__
    while tb is not None:
        out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


def _place(frame, lineno: int) -> str:
    import os

    path = frame.f_code.co_filename
    module = str(frame.f_globals.get("__name__") or "")
    if module.partition(".")[0] == "kvconform":
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        where = f"{module} ({path})" if path[:1] == "<" else os.path.relpath(os.path.abspath(path), root)
        return f"{where}:{lineno} in {frame.f_code.co_name}"
    path = "/".join(path.replace("\\", "/").split("/")[-2:])
    try:
        this = frame.f_locals.get("self")
    except Exception:  # noqa: BLE001
        this = None
    where = f"{path}:{lineno} in {frame.f_code.co_name}"
    if this is not None and type(this).__module__ == _REFERENCE_MODULE:  # an inherited method on kvconform's reference
        return f"{where}, inherited by kvconform's {type(this).__name__} (kvconform/reference.py)"
    return where


def own_fault(exc: BaseException, through_subject_call: bool = False) -> dict | None:
    """Where ``exc`` shows a fault of kvconform's own code, or None when it is the subject's (or the model's).

    The traceback's frames are read by ``frame_owner``. Any frame of the subject's code makes it the subject's.
    Else, with at least one kvconform frame:

    * ``through_subject_call`` False (an exception that escaped a check: no kvconform code turned it into a verdict):
      kvconform's — its code called something that raised and did not handle it;
    * ``through_subject_call`` True (an exception raised inside a call kvconform makes *on the subject*: a forward
      with its cache, ``crop``, ``generate``...): kvconform's only when the innermost frames are kvconform's and
      among them runs its reference cache (its code, or a transformers method it inherits) — not the model's or a
      built-in subject's code, and not kvconform's glue around the call (a method the subject lacks, an answer of
      the wrong type: the subject's, as the checks report).

    A ``TypeError`` of a call the callee's signature refused, raised in kvconform's frame before the callee runs, is
    the callee's (``refused_callee_owner``) unless the callee is kvconform's.

    Returns ``{"place": "kvconform/checks/_measure.py:219 in tensors_of", "raised_in": place of the innermost frame
    (None when it is the same), "what": "TypeError: first line"}``.
    """
    frames = _frames(exc)
    owners = [frame_owner(f) for f, _ in frames]
    if "subject" in owners or "kvconform" not in owners:
        return None
    last = max(i for i, o in enumerate(owners) if o == "kvconform")
    if last == len(frames) - 1 and refused_callee_owner(exc, frames[-1][0]) not in (None, "kvconform"):
        return None  # kvconform called the subject's (or transformers') function, whose signature refused the call
    if through_subject_call:
        # inside a call on the subject only kvconform's reference cache (its code, or a transformers method it
        # inherits) raising is kvconform's: kvconform's glue around the call (compat.crop calling a crop the subject
        # lacks, int() of its answer) reports on the subject, as the checks expect
        tail = len(frames)
        while tail > 0 and owners[tail - 1] == "kvconform":
            tail -= 1
        if tail == len(frames) or not any(_reference_frame(f) for f, _ in frames[tail:]):
            return None
    text = str(exc).strip().splitlines()
    inner = frames[-1]
    return {"place": _place(*frames[last]),
            "raised_in": None if last == len(frames) - 1 else _place(*inner),
            "what": f"{type(exc).__name__}: {text[0][:200] if text else ''}".rstrip(": ")}
