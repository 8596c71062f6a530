"""What the reports of a run need to know about its session, as plain data: the ``RunDigest``.

The matrix, the JSON report, the known-fault summary and a crashed item's message read the run's subjects, models,
known faults and plan, but never a cache or a model. Under pytest-xdist (the default ``pytest --kvconform``) the
workers run the items and the controller only reports, so the controller reads the digest a worker wrote
(``RunDigest.write`` / ``RunDigest.read``) instead of building a session itself: building one imports torch and
transformers (~5 s of CPU on the two cores the workers start on). A run without workers builds it from its own
session (``KVSession.digest``). This module imports only the standard library.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field

DIGEST_FILE = "digest.json"
"""The digest's file name in a run's folder (``workers.RUNDIR_KEY``)."""
USAGE_ERROR_FILE = "usage-error.txt"
"""A worker's usage error (exit 4), for the controller to raise, in a run's folder."""
BUILD_ERROR_FILE = "build-error.txt"
"""The traceback of an exception a worker raised building its session that is no usage error (a bug in kvconform or
in what it imports), for the controller to raise as an internal error (exit 3), in a run's folder."""


def item_id(nodeid: str) -> str:
    """The item id (``PlanItem.id``, the key of ``RunDigest.items`` and ``RunDigest.known_faults``) in a suite node
    id: its parameter, ``test_conformance.py::test_conformance[<id>]``."""
    return nodeid.partition("[")[2].removesuffix("]")


@dataclass
class SubjectFacts:
    """What the reports need of one subject.

    Attributes:
        name: the subject's name (matrix rows, JSON ``subject``).
        kind: its kind's name (``subjects.kinds.KIND_NAMES``; ``""`` when unknown, e.g. read back from a JSON
            report).
        builtin: whether kvconform ships it (the undeclared-kind hint is for users' caches only).
        fresh_target: whether a fresh instance of its own class is what it is compared with (``kinds.FRESH``).
        source: where it came from (``CacheSpec.source``: ``"builtin"``, a ``module:attr`` spec, ``remote code ...``),
            for the ``reproduce:`` line.
        expected_failures: the keys of its ``CacheSpec.expected_failures`` (``check`` or ``check:case``).
    """

    name: str
    kind: str = ""
    builtin: bool = False
    fresh_target: bool = False
    source: str = "builtin"
    expected_failures: list = field(default_factory=list)

    def expects_failure(self, check: str, case: str) -> bool:
        """Whether its own ``expected_failures`` name ``check`` (on every case) or ``check:case``."""
        return check in self.expected_failures or f"{check}:{case}" in self.expected_failures


@dataclass
class RunDigest:
    """A run's session as the reports see it (plain data, JSON round-trip).

    Attributes:
        header: the ``kvconform ...`` lines of the terminal header.
        environment: the JSON report's ``environment`` object (versions, device, strict, subjects, models, ...).
        subjects: ``SubjectFacts`` in the session's order.
        models: the models' names, in the session's order.
        model_specs: model name → the spec that selects it again (``--kvconform-model``).
        strict: ``--kvconform-strict``.
        stale_faults: known-fault entries that match no planned item (``KVSession.stale_faults``), each
            ``{"id", "transformers", "source"}``.
        known_faults: item id → ``{"id": entry id, "shared_by_fresh": bool, "judged_at_run_time": bool}`` for every
            planned item a known-fault entry names (``KVSession.fault_entry``); ``shared_by_fresh``: the subject is
            compared with a fresh instance of itself and the entry matches kvconform's ReferenceCache there too (a
            fault of the model's code, which that instance shares, so a pass says nothing about it);
            ``judged_at_run_time``: the entry excuses a failure only after seeing it (``KnownFault.envelope`` or
            ``evidence``), so its items run unmarked and a pass is recorded as a plain pass.
        items: item id → ``{"subject", "model", "check", "family", "case", "dtype", "batch"}``
            (``PlanItem.record``), every planned item.
        reproduce_args: the run's own flags for a ``reproduce:`` line (``KVSession.reproduce_args``).
        costs: item id → its estimated cost (``merge.item_cost``: relative to a logits item, a skipped item almost
            nothing), which the workers' scheduling orders by (``workers.model_scheduling``).
    """

    header: list = field(default_factory=list)
    environment: dict = field(default_factory=dict)
    subjects: list = field(default_factory=list)
    models: list = field(default_factory=list)
    model_specs: dict = field(default_factory=dict)
    strict: bool = False
    stale_faults: list = field(default_factory=list)
    known_faults: dict = field(default_factory=dict)
    items: dict = field(default_factory=dict)
    reproduce_args: list = field(default_factory=list)
    costs: dict = field(default_factory=dict)

    @property
    def subject_names(self) -> list[str]:
        return [s.name for s in self.subjects]

    def subject(self, name: str) -> SubjectFacts | None:
        return next((s for s in self.subjects if s.name == name), None)

    def known_fault(self, record: dict) -> dict | None:
        """The ``known_faults`` entry of a result record (its ``nodeid``), or None."""
        return self.known_faults.get(item_id(record["nodeid"]))

    @classmethod
    def from_environment(cls, environment: dict) -> RunDigest:
        """The digest a JSON report still carries (``kvconform-merge``): its environment and the subjects' and
        models' orders; nothing about kinds, faults or the plan."""
        return cls(environment=dict(environment),
                   subjects=[SubjectFacts(name=n) for n in environment.get("subjects") or ()],
                   models=list(environment.get("models") or ()), strict=bool(environment.get("strict")))

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> RunDigest:
        data = json.loads(text)
        data["subjects"] = [SubjectFacts(**s) for s in data.get("subjects", ())]
        return cls(**data)

    def write(self, folder: str) -> None:
        """Write ``folder/digest.json`` atomically (a temp file, then a rename): a reader sees all or nothing."""
        write_atomically(os.path.join(folder, DIGEST_FILE), self.to_json())

    @classmethod
    def read(cls, folder: str) -> RunDigest | None:
        """``folder/digest.json``, or None while no worker has written it."""
        try:
            with open(os.path.join(folder, DIGEST_FILE), encoding="utf-8") as fh:
                return cls.from_json(fh.read())
        except FileNotFoundError:
            return None


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and a rename, so that a reader (the xdist
    controller, a CI step reading a JSON report while the run goes on) sees the old file or the new one, never a
    part. The file gets an ordinary file's mode (0666 less the umask; ``mkstemp`` makes 0600). Every file kvconform
    writes whole goes through here: the JSON reports, a merged report, the run digest."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".kvconform-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def reproduce_line(source: str, subject: str, model_spec: str, selection: str, options=()) -> str:
    """The ``reproduce:`` line of a failure message: a command that runs just this item again, under the same run
    options — ``pytest --kvconform [--kvconform-cache SPEC] --kvconform-model MODEL [OPTIONS] -k "SELECTION"``.

    Args:
        source: the subject's ``CacheSpec.source``. A subject given as a ``module:attr`` / ``file.py:attr`` spec is
            named with ``--kvconform-cache``; a repository's own cache (``remote code ...``) is found again in its
            code (the line adds ``--kvconform-trust-remote-code``); a model adapter's cache (``model adapter SPEC``,
            ``kvconform.scratch``) is found again by its ``--kvconform-model``; one declared in Python (conftest hook,
            ``parametrize_with_checks``, ``check_cache``) is said to need that code.
        subject: the subject's name.
        model_spec: the ``--kvconform-model`` value.
        selection: the ``-k`` expression (the item id).
        options: the run's own flags that change what an item does (``KVSession.reproduce_args``: case files,
            strict, full tier, timeout, device, known-faults files), already shell-quoted.
    """
    import shlex

    args = ["pytest", "--kvconform"]
    remote = source.startswith("remote code ")
    adapter = source.startswith("model adapter ")  # a from-scratch model's cache: --kvconform-model finds it again
    if ":" in source and not remote and not adapter:
        args += ["--kvconform-cache", shlex.quote(source)]
    trust = ["--kvconform-trust-remote-code"] if remote and "--kvconform-trust-remote-code" not in options else []
    args += ["--kvconform-model", shlex.quote(model_spec), *options, *trust, "-k", f'"{selection}"']
    where = "" if source == "builtin" or ":" in source or remote or adapter else \
        f"   (where your code declares {subject})"
    return "reproduce: " + " ".join(args) + where
