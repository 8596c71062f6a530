"""kvconform's pytest plugin: hooks only.

Loaded in every pytest run of an environment where kvconform is installed (``pytest11`` entry point), so the top
level imports only pytest and the standard library; torch and transformers are imported inside hooks, and only
when ``--kvconform`` (or the ``kvconform = true`` ini option) is set. Without it every hook returns at once.
"""

from __future__ import annotations

import fnmatch
import os
import tempfile
from pathlib import Path

import pytest

from kvconform.families import FAMILIES
from kvconform.outcomes import with_article

SUITE_DIR = Path(__file__).parent / "suite"
SUITE_FILE = SUITE_DIR / "test_conformance.py"
PROPERTY = "kvconform"

OPT_ACTIVE, OPT_CACHE, OPT_MODEL = "kvconform", "kvconform_cache", "kvconform_model"
OPT_JSON, OPT_STRICT, OPT_CASES, OPT_DEVICE = "kvconform_json", "kvconform_strict", "kvconform_cases", "kvconform_device"
OPT_FULL, OPT_SELFTEST, OPT_TIMEOUT = "kvconform_full", "kvconform_selftest", "kvconform_timeout"
OPT_FAULTS, OPT_SUBJECT, OPT_SEED = "kvconform_known_faults", "kvconform_subject", "kvconform_fuzz_seed"
SELFTEST_FILE = SUITE_DIR / "test_selftest.py"

SESSION_KEY = pytest.StashKey["object"]()
RESULTS_KEY = pytest.StashKey["dict"]()


# ------------------------------------------------------------------------------------------------------ options
def pytest_addoption(parser):
    group = parser.getgroup("kvconform", "KV-cache conformance (kvconform)")
    group.addoption("--kvconform", action="store_true", dest=OPT_ACTIVE, default=None,
                    help="run the kvconform conformance suite (injected; works in an empty folder)")
    group.addoption("--kvconform-cache", action="append", dest=OPT_CACHE, default=None, metavar="SPEC",
                    help="add a subject: 'pkg.module:Attr' or 'path/file.py:Attr' (a Cache subclass or factory); "
                         "repeatable")
    group.addoption("--kvconform-subject", action="append", dest=OPT_SUBJECT, default=None, metavar="NAME",
                    help="run only these subjects (by name, e.g. your own cache's); kvconform's ReferenceCache still "
                         "gives every failure its oracle line; repeatable")
    group.addoption("--kvconform-model", action="append", dest=OPT_MODEL, default=None, metavar="SPEC",
                    help="limit the run to these models: a zoo name or a local checkpoint folder; repeatable")
    group.addoption("--kvconform-cases", action="append", dest=OPT_CASES, default=None, metavar="PATH",
                    help="extra case files or folders of *.toml (added to the built-in cases); repeatable")
    group.addoption("--kvconform-known-faults", action="append", dest=OPT_FAULTS, default=None, metavar="PATH",
                    help="extra known-faults files (same format as kvconform/known_faults.toml), read after the "
                         "bundled one; repeatable")
    group.addoption("--kvconform-json", dest=OPT_JSON, default=None, metavar="PATH",
                    help="write the JSON report (schema 1) to PATH")
    group.addoption("--kvconform-strict", action="store_true", dest=OPT_STRICT, default=None,
                    help="ignore the bundled list of known upstream faults: they fail instead of xfail")
    group.addoption("--kvconform-full", action="store_true", dest=OPT_FULL, default=None,
                    help="also run the heavier tier (cases with tier = \"full\", default cases on their models_full: "
                         "compile on every model, long fuzzing, long contexts); meant for CI")
    group.addoption("--kvconform-selftest", action="store_true", dest=OPT_SELFTEST, default=None,
                    help="run kvconform's bundled faulty caches through the suite instead of the subjects, and "
                         "print the share caught per check family")
    group.addoption("--kvconform-timeout", dest=OPT_TIMEOUT, default=None, type=float, metavar="SECONDS",
                    help="fail an item whose subject runs longer than this (default 300; 0 disables)")
    group.addoption("--kvconform-fuzz-seed", dest=OPT_SEED, default=None, metavar="N|random",
                    help="draw other random op programs in the fuzz family (default: fixed seeds, the same programs "
                         "every run); 'random' picks N and prints it in the header to replay")
    group.addoption("--kvconform-device", dest=OPT_DEVICE, default=None, metavar="DEVICE",
                    help="torch device for the models under test (default: cpu)")
    parser.addini(OPT_ACTIVE, "run the kvconform suite (same as --kvconform)", type="bool", default=False)
    parser.addini(OPT_CACHE, "extra subjects (same as --kvconform-cache)", type="linelist", default=[])
    parser.addini(OPT_MODEL, "models to run (same as --kvconform-model)", type="linelist", default=[])
    parser.addini(OPT_SUBJECT, "subjects to run (same as --kvconform-subject)", type="linelist", default=[])
    parser.addini(OPT_CASES, "extra case files (same as --kvconform-cases)", type="linelist", default=[])
    parser.addini(OPT_FAULTS, "extra known-faults files (same as --kvconform-known-faults)", type="linelist",
                  default=[])
    parser.addini(OPT_JSON, "JSON report path (same as --kvconform-json)", default="")
    parser.addini(OPT_STRICT, "known upstream faults fail (same as --kvconform-strict)", type="bool", default=False)
    parser.addini(OPT_FULL, "run the heavier tier (same as --kvconform-full)", type="bool", default=False)
    parser.addini(OPT_SELFTEST, "run the selftest (same as --kvconform-selftest)", type="bool", default=False)
    parser.addini(OPT_TIMEOUT, "per-item timeout in seconds (same as --kvconform-timeout)", default="300")
    parser.addini(OPT_DEVICE, "torch device (same as --kvconform-device)", default="cpu")


def _opt(config, name):
    """Command-line value if given, else the ini twin (paths in it relative to the ini file's folder)."""
    value = config.getoption(name)
    if value is not None:
        return value
    value = config.getini(name)
    if name in _INI_PATHS and value and config.inipath is not None:
        base = config.inipath.parent
        value = [_from_ini(base, name, v) for v in value] if isinstance(value, list) else _from_ini(base, name, value)
    return value


_INI_PATHS = (OPT_CACHE, OPT_MODEL, OPT_CASES, OPT_JSON, OPT_FAULTS)


def _from_ini(base, name: str, value: str) -> str:
    """A path given in an ini file is relative to that file's folder (pytest's convention for ini paths), so the
    run does not depend on the folder pytest is started from. Module specs (``pkg.mod:Attr``) and zoo names stay."""
    if name == OPT_CACHE:
        path, sep, attr = value.rpartition(":")
        if sep and path.endswith(".py") and not os.path.isabs(os.path.expanduser(path)):
            return f"{base / path}:{attr}"
        return value
    if os.path.isabs(os.path.expanduser(value)):
        return value
    if name == OPT_MODEL and "/" not in value and not value.startswith(".") and not (base / value).is_dir():
        return value  # a zoo family
    return str(base / value)


def is_active(config) -> bool:
    return bool(_opt(config, OPT_ACTIVE))


_FLAGS = {OPT_CACHE: "--kvconform-cache", OPT_SUBJECT: "--kvconform-subject", OPT_MODEL: "--kvconform-model", OPT_CASES: "--kvconform-cases",
          OPT_JSON: "--kvconform-json", OPT_STRICT: "--kvconform-strict", OPT_FULL: "--kvconform-full",
          OPT_SELFTEST: "--kvconform-selftest", OPT_TIMEOUT: "--kvconform-timeout", OPT_DEVICE: "--kvconform-device",
          OPT_SEED: "--kvconform-fuzz-seed"}


def _refuse_flags_without_kvconform(config) -> None:
    """A ``--kvconform-*`` flag on the command line without ``--kvconform`` would check nothing and exit 0 with the
    project's own tests: a usage error (exit 4) instead. Ini settings (``kvconform_cache = ...``) stay allowed — a
    project may keep them in its ini file for the runs that add ``--kvconform``.

    Raises:
        pytest.UsageError: naming the flags given and the fix.
    """
    given = [flag for dest, flag in _FLAGS.items() if config.getoption(dest) is not None]
    if given:
        raise pytest.UsageError(
            f"kvconform: {', '.join(given)} given without --kvconform, so nothing would be checked; add --kvconform "
            f"to run the conformance suite (or set kvconform = true in the ini file)")


_BENCHMARK_DEFAULT_STORAGE = "file://./.benchmarks"
_BENCHMARK_SAVING = ("benchmark_save", "benchmark_autosave", "benchmark_compare", "benchmark_compare_fail")


def _keep_benchmarks_out_of_the_folder(config) -> None:
    """pytest-benchmark creates its storage folder (``./.benchmarks``) at configure time, in every run, even when
    nothing is saved. Under ``--kvconform`` in a folder that has none, and unless the user chose a storage or asked
    to save or compare runs, point it at a folder under the system temp dir so that a run leaves nothing behind."""
    storage = getattr(config.option, "benchmark_storage", None)
    if storage != _BENCHMARK_DEFAULT_STORAGE or Path(".benchmarks").exists():
        return
    if any(getattr(config.option, name, None) for name in _BENCHMARK_SAVING):
        return
    config.option.benchmark_storage = "file://" + os.path.join(tempfile.gettempdir(), "kvconform-benchmarks")


# ------------------------------------------------------------------------------------------------------ configure
# One marker per check family (kvconform.families: torch-free, unlike kvconform.checks).
FAMILY_MARKERS = FAMILIES
MARKERS = {"kvconform": "an item of the kvconform conformance suite",
           **{f"kvconform_{f}": f"kvconform check family '{f}'" for f in FAMILY_MARKERS}}


def pytest_addhooks(pluginmanager):
    from kvconform import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


# tryfirst: runs before pytest-benchmark's pytest_configure, which creates its storage folder.
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if not is_active(config):
        _refuse_flags_without_kvconform(config)
        return
    from kvconform.session import build_session

    _keep_benchmarks_out_of_the_folder(config)
    _check_usage(config)
    hooked = _hooked_specs(config)
    try:
        config.stash[SESSION_KEY] = build_session(
            caches=[*_opt(config, OPT_CACHE), *hooked], models=_opt(config, OPT_MODEL),
            case_paths=_opt(config, OPT_CASES),
            strict=bool(_opt(config, OPT_STRICT)), device=_opt(config, OPT_DEVICE) or "cpu",
            full=bool(_opt(config, OPT_FULL)), known_faults=_opt(config, OPT_FAULTS),
            only_subjects=_opt(config, OPT_SUBJECT),
        )
    except ValueError as exc:  # SpecError, CaseFileError, KnownFaultsError, bad model spec
        raise pytest.UsageError(f"kvconform: {exc}") from None
    config.stash[SESSION_KEY].fuzz_seed = _fuzz_seed(config)
    config.stash[SESSION_KEY].reproduce_args = _reproduce_args(config)
    config.stash[RESULTS_KEY] = {}
    suite_ids = _point_suite_node_ids_at_the_suite(config)
    if not suite_ids and str(SUITE_DIR) not in config.args:
        config.args.append(str(SUITE_DIR))


def pytest_ignore_collect(collection_path, config):
    # The suite only makes sense with --kvconform (it needs the generated parameters); the selftest module runs
    # instead of the conformance module under --kvconform-selftest.
    if SUITE_DIR not in (collection_path, *collection_path.parents):
        return None
    if not is_active(config):
        return True
    selftest = bool(_opt(config, OPT_SELFTEST))
    if collection_path == (SUITE_FILE if selftest else SELFTEST_FILE):
        return True
    return None


def pytest_collect_file(file_path, parent):
    # A user python_files setting (e.g. check_*.py) would drop the suite: collect it ourselves then.
    config = parent.config
    if not is_active(config) or file_path not in (SUITE_FILE, SELFTEST_FILE):
        return None
    if any(fnmatch.fnmatch(file_path.name, pat) for pat in config.getini("python_files")):
        return None
    return pytest.Module.from_parent(parent, path=file_path)


def pytest_report_header(config):
    if not is_active(config):
        return None
    return config.stash[SESSION_KEY].header_lines()


# ------------------------------------------------------------------------------------------------------ collection
def pytest_generate_tests(metafunc):
    if not is_active(metafunc.config):
        return
    session = metafunc.config.stash[SESSION_KEY]
    if "kv_selftest" in metafunc.fixturenames:
        from kvconform.testing import faulty_caches

        metafunc.parametrize("kv_selftest", [pytest.param(f, id=f.name) for f in faulty_caches()])
    if "kv_item" not in metafunc.fixturenames:
        return
    if any(m.args and m.args[0] == "kv_item" for m in metafunc.definition.iter_markers("parametrize")):
        return  # a user test decorated with kvconform.parametrize_with_checks
    params = [pytest.param(item, id=item.id, marks=item.marks(pytest)) for item in session.items()]
    metafunc.parametrize("kv_item", params)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    if not is_active(config):
        return
    from kvconform.report import encode_property

    ours = [it for it in items if PROPERTY in it.keywords and hasattr(it, "callspec")]
    if not ours:
        raise pytest.UsageError(
            "kvconform: --kvconform is set but no conformance items were collected "
            "(was the packaged suite excluded by a collection setting?)")
    for it in ours:
        if "kv_item" in it.callspec.params:
            # JSON, so that --junitxml properties are machine-readable (report.py decodes them)
            it.user_properties.append((PROPERTY, encode_property(it.callspec.params["kv_item"].describe())))


# ------------------------------------------------------------------------------------------------------ running
@pytest.fixture(scope="session")
def kv_session(request):
    """The per-process kvconform session (models, oracles, plan). Without --kvconform (a user test decorated
    with ``kvconform.parametrize_with_checks``) a bare session is built: no subjects of its own."""
    if is_active(request.config):
        return request.config.stash[SESSION_KEY]
    from kvconform.session import build_session

    return build_session(builtin=False)


def _point_suite_node_ids_at_the_suite(config) -> bool:
    """Let a node id printed by a run (``test_conformance.py::test_conformance[...]`` in a FAILED line, which is
    relative to the installed suite's folder) be pasted back: such arguments are rewritten to the suite file's
    path. Returns True when the command line names suite items, so that the whole suite is not added as well."""
    named = False
    for i, arg in enumerate(config.args):
        path, sep, rest = str(arg).partition("::")
        base = os.path.basename(path)
        if base not in (SUITE_FILE.name, SELFTEST_FILE.name):
            continue
        if os.path.exists(os.path.join(config.invocation_params.dir, path)) and \
                os.path.abspath(os.path.join(config.invocation_params.dir, path)) not in (str(SUITE_FILE),
                                                                                            str(SELFTEST_FILE)):
            continue  # the user's own file of that name
        config.args[i] = str(SUITE_DIR / base) + sep + rest
        named = True
    return named


def _fuzz_seed(config) -> int | None:
    """``--kvconform-fuzz-seed``: None (fixed seeds), an int, or a random int for ``random`` (the header prints it).
    Under xdist the controller draws it and the workers read it back from their ``workerinput``.

    Raises:
        pytest.UsageError: neither an integer ≥ 0 nor ``random``.
    """
    value = config.getoption(OPT_SEED)
    worker = getattr(config, "workerinput", None)
    if worker is not None and "kvconform_fuzz_seed" in worker:
        return worker["kvconform_fuzz_seed"]
    if value is None:
        return None
    if value == "random":
        import random

        seed = random.SystemRandom().randrange(2 ** 31)
    elif value.isdigit():
        seed = int(value)
    else:
        raise pytest.UsageError(f"kvconform: --kvconform-fuzz-seed {value!r}: an integer ≥ 0 or 'random'")
    config._kvconform_fuzz_seed = seed
    return seed


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller → worker: the same fuzz seed in every worker (``random`` is drawn once)."""
    seed = getattr(node.config, "_kvconform_fuzz_seed", None)
    if seed is not None:
        node.workerinput["kvconform_fuzz_seed"] = seed


def _reproduce_args(config) -> tuple:
    """The flags of this run that change what an item does, shell-quoted, for its ``reproduce:`` line (paths made
    absolute, so that the line works from any folder)."""
    import shlex

    args = []
    for path in _opt(config, OPT_CASES) or ():
        args += ["--kvconform-cases", shlex.quote(os.path.abspath(path))]
    for path in _opt(config, OPT_FAULTS) or ():
        args += ["--kvconform-known-faults", shlex.quote(os.path.abspath(path))]
    if _opt(config, OPT_STRICT):
        args.append("--kvconform-strict")
    if _opt(config, OPT_FULL):
        args.append("--kvconform-full")
    timeout = _timeout(config)
    if timeout != 300:
        args += ["--kvconform-timeout", f"{timeout:g}"]
    device = _opt(config, OPT_DEVICE) or "cpu"
    if device != "cpu":
        args += ["--kvconform-device", shlex.quote(device)]
    if config.stash[SESSION_KEY].fuzz_seed is not None:
        args += ["--kvconform-fuzz-seed", str(config.stash[SESSION_KEY].fuzz_seed)]
    return tuple(args)


def _hooked_specs(config) -> list:
    """The subjects every ``pytest_kvconform_caches`` implementation returned, flattened.

    Raises:
        pytest.UsageError: an implementation returned something else than a list (or tuple) — e.g. one CacheSpec
            instead of ``[CacheSpec(...)]`` — naming the plugin (the conftest.py) that did.
    """
    out = []
    impls = config.pluginmanager.hook.pytest_kvconform_caches.get_hookimpls()
    for impl in reversed(impls):  # pluggy's call order
        specs = impl.function(**({"config": config} if "config" in impl.argnames else {}))
        if specs is None:
            continue
        if not isinstance(specs, (list, tuple)):
            where = getattr(impl.plugin, "__file__", None) or impl.plugin_name
            raise pytest.UsageError(
                f"kvconform: pytest_kvconform_caches in {where} returned {with_article(type(specs).__name__)}; it "
                f"must return a list of subjects, e.g. return [kvconform.CacheSpec(...)]")
        out.extend(specs)
    return out


def _timeout(config) -> float:
    value = config.getoption(OPT_TIMEOUT)
    return float(config.getini(OPT_TIMEOUT) if value is None else value)


def _check_usage(config) -> None:
    """Usage errors (exit 4, one line) for the option values that would otherwise fail every item or the end of
    the run: the JSON report path, the per-item timeout, the torch device.

    Raises:
        pytest.UsageError: naming the option, the value and the cause.
    """
    from kvconform.report import json_path_problem

    path = _opt(config, OPT_JSON)
    if path and (problem := json_path_problem(path)):
        raise pytest.UsageError(f"kvconform: --kvconform-json {path!r}: {problem}")
    try:
        timeout = _timeout(config)
    except ValueError:
        raise pytest.UsageError(f"kvconform: kvconform_timeout {config.getini(OPT_TIMEOUT)!r}: not a number") from None
    if timeout < 0:
        raise pytest.UsageError(f"kvconform: --kvconform-timeout {timeout:g}: must be ≥ 0 (0 disables the timeout)")
    device = _opt(config, OPT_DEVICE) or "cpu"
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise pytest.UsageError(f"kvconform: --kvconform-device {device!r}: not a torch device ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"kvconform: --kvconform-device {device!r}: CUDA is not available in this torch "
                                f"({torch.__version__})")
    if dev.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"kvconform: --kvconform-device {device!r}: kvconform runs on cpu or cuda")


@pytest.fixture
def kv_runner(kv_session, request):
    """``kv_runner(item)`` runs one conformance item and records its metrics on the report."""
    from kvconform.session import item_timeout

    def run(item):
        from kvconform.checks import CheckSkipped, KnownFaultShown
        from kvconform.report import encode_property

        metrics = {}
        benchmark = None
        if item.check.family == "speed":
            # Timing budgets mean nothing while xdist workers share the CPU: skip, never pass (checks/speed.py).
            if hasattr(request.config, "workerinput"):
                pytest.skip("speed budgets are not measured under xdist (-n): parallel workers share the machine; "
                            "run them serially, e.g. pytest --kvconform -m kvconform_speed")
            if request.config.pluginmanager.hasplugin("benchmark"):
                benchmark = request.getfixturevalue("benchmark")
        try:
            with item_timeout(_timeout(request.config), item, kv_session.reproduce_args):
                metrics.update(kv_session.run(item, benchmark=benchmark))
        except CheckSkipped as exc:
            pytest.skip(str(exc))
        except KnownFaultShown as exc:  # a known fault judged by its evidence, at run time
            metrics.update(exc.metrics)
            pytest.xfail(str(exc))
        except Exception as exc:
            metrics.update(getattr(exc, "metrics", {}) or {})
            raise
        finally:
            request.node.user_properties.append((PROPERTY + "_metrics", encode_property(metrics)))

    return run


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.excinfo is not None and PROPERTY in item.keywords:
        from kvconform.checks import ConformanceError, Unexcused

        if isinstance(call.excinfo.value, (ConformanceError, Unexcused)) and report.failed:
            report.longrepr = str(call.excinfo.value)
    return report


def pytest_runtest_logreport(report):
    props = dict(report.user_properties or ())
    if PROPERTY not in props:
        return
    config = _CONFIG.get("config")
    if config is None or RESULTS_KEY not in config.stash:
        return
    from kvconform.report import record_report

    record_report(config.stash[RESULTS_KEY], report, props)


_CONFIG: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    if is_active(session.config):
        _CONFIG["config"] = session.config


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not is_active(config) or RESULTS_KEY not in config.stash:
        return
    from kvconform.report import write_known_fault_summary, write_markdown_summary, write_terminal_matrix

    results = config.stash[RESULTS_KEY]
    write_terminal_matrix(terminalreporter, results, config.stash[SESSION_KEY])
    if _opt(config, OPT_SELFTEST):
        from kvconform.report import write_selftest_summary

        write_selftest_summary(terminalreporter)
    else:
        write_known_fault_summary(terminalreporter, results, config.stash[SESSION_KEY])
    if not hasattr(config, "workerinput"):  # xdist workers: the controller writes the one combined summary
        write_markdown_summary(results, os.environ.get("GITHUB_STEP_SUMMARY"), config.stash[SESSION_KEY])


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not is_active(config) or hasattr(config, "workerinput") or RESULTS_KEY not in config.stash:
        return
    path = _opt(config, OPT_JSON)
    if not path:
        return
    from kvconform.report import write_json

    write_json(path, config.stash[RESULTS_KEY], config.stash[SESSION_KEY])


def pytest_unconfigure(config):
    _CONFIG.pop("config", None)

