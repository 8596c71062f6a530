"""Model repositories that ship their own code (config.json ``auto_map`` → ``configuration_*.py`` /
``modeling_*.py``, loaded with ``trust_remote_code``), and the cache classes that code defines.

Running a repository's code is the user's explicit decision: ``--kvconform-trust-remote-code`` (ini
``kvconform_trust_remote_code``). Without it such a folder is a usage error naming the flag and the code files it
would run (``consent_problem``); kvconform never lets transformers prompt on stdin ("Do you wish to run the custom
code?"), since it always passes ``trust_remote_code`` explicitly. With it, the model is loaded with that code, and
``repository_cache_subjects`` turns the repository's own ``transformers.Cache`` subclasses into subjects: every one
its modeling code defines, and the class its model creates by itself when no cache is passed.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

TRUST_FLAG = "--kvconform-trust-remote-code"


def code_files(path: str) -> list[str]:
    """The code a checkpoint folder would make transformers run: the files named by config.json's ``auto_map``
    (``"modeling_hybrid.HybridForCausalLM"`` → ``modeling_hybrid.py``, ``"other/repo--file.Cls"`` names a file of
    another repository and is listed as it is written), then every other ``*.py`` file of the folder. Empty for an
    ordinary checkpoint (no ``auto_map``, no ``*.py``). Paths are relative to ``path``, sorted within each part.
    """
    named = []
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            auto_map = json.load(fh).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        auto_map = {}
    for ref in auto_map.values():
        for one in ref if isinstance(ref, (list, tuple)) else [ref]:
            if isinstance(one, str) and "." in one:
                module = one.rsplit(".", 1)[0]
                named.append(module if "--" in module else module.replace(".", "/") + ".py")
    files = sorted(set(named))
    others = sorted(os.path.relpath(p, path) for p in glob.glob(os.path.join(path, "*.py")))
    return files + [f for f in others if f not in files]


def consent_problem(spec: str, path: str, trusted: bool) -> str | None:
    """Why loading ``path`` needs the user's consent first, or None (ordinary checkpoint, or ``trusted``)."""
    files = code_files(path)
    if not files or trusted:
        return None
    return (f"--kvconform-model {spec!r}: this repository ships its own code, which loading it would run: "
            f"{', '.join(files)}; kvconform runs it only with your explicit consent: add {TRUST_FLAG} "
            f"(or kvconform_trust_remote_code = true in the ini file) if you trust this code")


def _repository_modules(model) -> list:
    """The modules of the repository's code that ``model`` came from: every loaded module of the dynamic package
    transformers copied the repository's files into (``transformers_modules.<repo>.<hash>``)."""
    import sys

    module = type(model).__module__
    if not module.startswith("transformers_modules."):
        return []
    package = module.rsplit(".", 1)[0] + "."
    return [m for name, m in sorted(sys.modules.items()) if name.startswith(package) and m is not None]


def _default_cache_class(model, vocab_size: int):
    """The class of the cache ``model`` creates by itself: one forward of 4 tokens with ``use_cache=True`` and no
    cache passed. None when it returns none (or raises: the items report that model's failures)."""
    import torch

    ids = torch.arange(3, 7).remainder(max(vocab_size, 8)).unsqueeze(0).to(next(model.parameters()).device)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
    except Exception:  # noqa: BLE001 - the model's own failures are for its items to report
        return None
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    return type(cache) if cache is not None else None


def repository_cache_subjects(zm, repo_path: str) -> tuple[list, list[str]]:
    """The repository's own cache classes as subjects, and one header line per class found.

    A class is taken when it is a ``transformers.Cache`` subclass defined in one of the repository's modules
    (``_repository_modules``), or when it is the class of the cache the model creates when no cache is passed and
    it is not one of transformers' own (then it is tested whatever module defines it). Each subject is named
    ``<model name>.<class>`` (``hybrid_repo.HybridRepoCache``), runs on that model only (other models of the run
    have other configs), and declares what its class declares (``kvconform_*`` attributes); its ``source`` says
    which file and class it comes from (``"remote code hybrid_repo/modeling_hybrid.py:HybridRepoCache"``), and
    failure messages repeat it.

    Args:
        zm: the loaded ``zoo.ZooModel`` of the repository (loaded with ``trust_remote_code``).
        repo_path: the repository folder as the user gave it.
    """
    import inspect

    from transformers import Cache

    from kvconform.subjects import as_cache_spec

    found: dict = {}
    for module in _repository_modules(zm.model):
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Cache) and obj.__module__ == module.__name__:
                found.setdefault(obj.__name__, (obj, "defined in"))
    default = _default_cache_class(zm.model, zm.vocab_size)
    if default is not None and issubclass(default, Cache):
        own = not (default.__module__ == "transformers" or default.__module__.startswith("transformers."))
        if own:
            found[default.__name__] = (default, "created by the model when no cache is passed; defined in")
    subjects, lines = [], []
    for cls_name, (cls, how) in sorted(found.items()):
        where = _source_file(cls, repo_path)
        spec = as_cache_spec(cls, source=f"remote code {where}:{cls_name}")
        name = f"{zm.name}.{cls_name}"
        model_name = zm.name

        def applies_to(model, _model=model_name, _name=name):
            return None if model.name == _model else f"{_name} is {_model}'s own cache class (its code, its config)"

        subjects.append(dataclasses.replace(spec, name=name, applies_to=applies_to))
        lines.append(f"kvconform repository {zm.name}: subject {name} (class {cls_name}, {how} {where})")
    if not subjects:
        lines.append(f"kvconform repository {zm.name}: its code defines no Cache subclass and its model creates "
                     f"{'none' if default is None else default.__name__} by itself; the built-in subjects run on it")
    return subjects, lines


def _source_file(cls, repo_path: str) -> str:
    """Where ``cls`` is written, as the user knows it: the repository's own file (``hybrid_repo/modeling_hybrid.py``;
    transformers runs a copy of it from its modules cache) when the file of that name is there, else the file that
    defines it."""
    import inspect

    try:
        defined = inspect.getsourcefile(cls) or ""
    except TypeError:
        defined = ""
    mine = os.path.join(repo_path, os.path.basename(defined)) if defined else ""
    return os.path.normpath(mine) if mine and os.path.isfile(mine) else (defined or cls.__module__)


def subject_origin(subject) -> str | None:
    """For a subject from a repository's code: ``"class X of path/file.py (the repository's own code)"``; else
    None. Failure messages print it under their headline."""
    source = getattr(subject, "source", "")
    if not isinstance(source, str) or not source.startswith("remote code "):
        return None
    where, _, cls = source.removeprefix("remote code ").rpartition(":")
    return f"class {cls} of {where} (the repository's own code, run with {TRUST_FLAG})"
