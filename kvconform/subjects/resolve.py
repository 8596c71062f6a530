"""Spec resolution: ``--kvconform-cache SPEC`` strings (``module:attr``, ``path/file.py:attr``) and Python
objects (Cache subclasses, factories) into ``CacheSpec`` (``resolve_cache_spec``, ``as_cache_spec``), and the build
check of a user factory before the run (``check_factory_builds_cache``)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys

from kvconform.outcomes import with_article
from kvconform.subjects.construction import (CONSTRUCTION_KWARGS, FactoryResultError, SubjectBuildError,
                                             required_unknown_arguments)
from kvconform.subjects.declare import _declared
from kvconform.subjects.spec import CacheSpec, SpecError, closest_name

# ---------------------------------------------------------------------------------------------------- user specs
def _import_file(path: str):
    """Import ``path`` as a module, the way pytest imports a conftest.py (its "prepend" import mode): the file's
    folder goes first on ``sys.path``, so that the file can import its sibling modules (``from paged_layer import
    PagedLayer``)."""
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    mod_name = "kvconform_user_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


def _import_module(target: str):
    """``importlib.import_module(target)``; when its top-level package is not importable but sits in the current
    folder (``pytest`` does not put the folder it is started from on ``sys.path``), import it from there, as
    ``python -m`` would."""
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        top = target.split(".")[0]
        here = os.getcwd()
        local = os.path.isfile(os.path.join(here, top + ".py")) or os.path.isdir(os.path.join(here, top))
        if exc.name != top or not local or here in sys.path:
            raise
        sys.path.insert(0, here)
        return importlib.import_module(target)


def _not_a_cache_hint(cls) -> str:
    """The fix for a class that is not a ``transformers.Cache``: for a cache *layer* (transformers'
    ``CacheLayerMixin``) pass the Cache that holds it; for any other class, subclass ``Cache`` or hand kvconform a
    factory returning one."""
    from transformers.cache_utils import CacheLayerMixin

    if issubclass(cls, CacheLayerMixin):
        return (f": {cls.__name__} is a cache layer (CacheLayerMixin); pass the Cache subclass that holds it, or a "
                f"factory such as def my_cache(config): return Cache(layers=[{cls.__name__}() for _ in ...])")
    if callable(getattr(cls, "compress", None)) or cls.__name__.endswith("Press"):
        # a KV press (kvpress's presses have compress() and are called on the model as a context manager)
        return (f": {cls.__name__} looks like a press, which compresses a cache from hooks on the model; name a "
                f"factory that returns the cache and the press applied to the model, e.g. def pressed(config, "
                f"model): return DynamicCache(config=config), {cls.__name__}(...)(model) — see docs/own-cache.md, "
                f"'Caches that need the model'")
    return (f"; make {cls.__name__} subclass transformers.Cache (or DynamicCache), or name a factory that returns "
            f"one, e.g. def my_cache(config): return MyCache(config=config)")


def resolve_cache_spec(spec: str) -> CacheSpec:
    """``"pkg.mod:Attr"`` or ``"path/file.py:Attr"`` → ``CacheSpec``.

    ``Attr`` may also be a ``CacheSpec`` instance (returned as is). Capabilities of a class may be declared in a
    ``kvconform_capabilities`` attribute (iterable of names); default: all. Its allocation granularity may be
    declared in a ``kvconform_page_size`` attribute (tokens per page, ``declared_page_size``); default: none.

    Raises:
        SpecError: malformed spec, module/file that does not import (with the exception), missing attribute,
            or an attribute that is neither a Cache subclass, a CacheSpec nor a callable.
    """
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise SpecError(f"{spec!r}: expected 'module:attr' or 'path/to/file.py:attr'")
    target, attr = spec.rsplit(":", 1)
    if not target or not attr.isidentifier():
        raise SpecError(f"{spec!r}: expected 'module:attr' or 'path/to/file.py:attr' (attr must be an identifier)")
    try:
        if target.endswith(".py") or os.sep in target:
            if not os.path.isfile(target):
                raise SpecError(f"{spec!r}: file {target!r} does not exist")
            module = _import_file(target)
        else:
            module = _import_module(target)
    except SpecError:
        raise
    except BaseException as exc:  # noqa: BLE001 - any import failure is the user's spec problem
        hint = ""
        if isinstance(exc, ModuleNotFoundError):
            hint = ("; give the file instead ('path/to/file.py:Attr' — its folder is put on sys.path, so it can "
                    "import its sibling modules) or make the module importable (pip install -e your package, "
                    "or PYTHONPATH)")
        raise SpecError(f"{spec!r}: importing {target!r} failed: {type(exc).__name__}: {exc}{hint}") from None
    if not hasattr(module, attr):
        close = closest_name(attr, [n for n in vars(module) if not n.startswith("_")])
        raise SpecError(f"{spec!r}: {_where(target)} has no attribute {attr!r}"
                        + (f" (did you mean {close!r}?)" if close else ""))
    obj = getattr(module, attr)
    if isinstance(obj, CacheSpec):
        return obj
    from transformers import Cache

    if inspect.isclass(obj):
        if not issubclass(obj, Cache):
            raise SpecError(f"{spec!r}: {attr} is a class but not a transformers.Cache subclass"
                            f"{_not_a_cache_hint(obj)}")
        return CacheSpec(attr, obj, source=spec, **_declared(obj, repr(spec)))
    if callable(obj):
        return CacheSpec(attr, obj, source=spec, **_declared(obj, repr(spec)))
    raise SpecError(f"{spec!r}: {attr} is {with_article(type(obj).__name__)}, not a Cache subclass or a factory")


def spec_problem_before_import(spec: str) -> str | None:
    """What ``resolve_cache_spec(spec)`` would refuse that can be seen without importing anything (so without torch):
    the whole message it would raise, or None. Checked by a pytest-xdist controller before its workers start, so
    that a mistyped spec is a usage error in a second instead of after every worker has imported torch and built
    its session (measured 27 s for a class-name typo on a loaded 2-core machine).

    Seen here: a malformed spec, a file that does not exist or does not parse (``SyntaxError``), a module whose
    top-level package is nowhere on ``sys.path`` nor in the current folder, and an attribute that the file (or the
    module's source file, found along its package's folders) never defines at its top level — with the same "did you
    mean" as the import would give. Anything the source cannot settle (``from x import *``, a module-level
    ``__getattr__``, an extension module, a namespace package, a name bound in a way the parser does not see) is left
    to the import: None.
    """
    import ast

    if not isinstance(spec, str) or spec.count(":") < 1:
        return f"{spec!r}: expected 'module:attr' or 'path/to/file.py:attr'"
    target, attr = spec.rsplit(":", 1)
    if not target or not attr.isidentifier():
        return f"{spec!r}: expected 'module:attr' or 'path/to/file.py:attr' (attr must be an identifier)"
    source: str | None = target
    if target.endswith(".py") or os.sep in target:
        if not os.path.isfile(target):
            return f"{spec!r}: file {target!r} does not exist"
    else:
        source, problem = _module_source(target)
        if problem:
            return f"{spec!r}: {problem}"
    if source is None:
        return None
    try:
        with open(source, "rb") as fh:
            tree = ast.parse(fh.read(), filename=source)
    except SyntaxError as exc:
        return f"{spec!r}: importing {target!r} failed: SyntaxError: {exc}"
    except (OSError, ValueError):
        return None
    names = _top_level_names(tree.body)
    # module-level code (not the bodies of functions and classes) that binds names the parser cannot see
    dynamic = any((isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                   and n.func.id in ("globals", "setattr", "exec", "vars"))
                  or (isinstance(n, ast.Attribute) and n.attr == "modules" and isinstance(n.value, ast.Name)
                      and n.value.id == "sys")  # sys.modules[__name__].X = ...
                  for top in tree.body if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  for n in ast.walk(top))
    if names is None or dynamic or attr in names:
        return None
    close = closest_name(attr, [n for n in names if not n.startswith("_")])
    return f"{spec!r}: {_where(target)} has no attribute {attr!r}" + (f" (did you mean {close!r}?)" if close else "")


def _where(target: str) -> str:
    """How a message names the target of a spec: ``file 'caches.py'`` for a path, ``module 'pkg.caches'`` else."""
    return f"file {target!r}" if target.endswith(".py") else f"module {target!r}"


def _module_source(target: str) -> tuple[str | None, str | None]:
    """``(source file, None)`` of module ``target`` found without importing it or its packages (its top-level
    package's ``find_spec``, then the folders), ``(None, problem)`` when its top-level package is nowhere (the
    message ``resolve_cache_spec`` gives), ``(None, None)`` when the layout is not one this walk settles."""
    parts = target.split(".")
    if not all(p.isidentifier() for p in parts):
        return None, None
    if parts[0] in sys.modules:
        top = getattr(sys.modules[parts[0]], "__spec__", None)
    else:
        try:
            top = importlib.util.find_spec(parts[0])
        except (ImportError, ValueError):
            return None, None
    if top is None:
        here = os.getcwd()
        local = [p for p in (os.path.join(here, parts[0] + ".py"), os.path.join(here, parts[0], "__init__.py"))
                 if os.path.isfile(p)]
        if not local:
            return None, (f"importing {target!r} failed: ModuleNotFoundError: No module named {parts[0]!r}; give the "
                          f"file instead ('path/to/file.py:Attr' — its folder is put on sys.path, so it can import "
                          f"its sibling modules) or make the module importable (pip install -e your package, or "
                          f"PYTHONPATH)")
        origin, folders = local[0], [os.path.dirname(local[0])] if local[0].endswith("__init__.py") else []
    else:
        origin, folders = top.origin, list(top.submodule_search_locations or ())
    for part in parts[1:]:
        if len(folders) != 1:
            return None, None  # a plain module has no submodules; a namespace package spans folders
        as_module = os.path.join(folders[0], part + ".py")
        as_package = os.path.join(folders[0], part, "__init__.py")
        if os.path.isfile(as_package):
            origin, folders = as_package, [os.path.dirname(as_package)]
        elif os.path.isfile(as_module):
            origin, folders = as_module, []
        elif os.path.isdir(os.path.join(folders[0], part)) or any(
                name.startswith(part + ".") for name in os.listdir(folders[0])):
            return None, None  # a namespace package or an extension module: the import will tell
        else:
            return None, (f"importing {target!r} failed: ModuleNotFoundError: No module named "
                          f"{'.'.join(parts[:parts.index(part) + 1])!r}")
    return (origin, None) if origin and origin.endswith(".py") and os.path.isfile(origin) else (None, None)


def _top_level_names(body) -> set | None:
    """The names a module's top-level statements bind (definitions, assignments, imports, also under top-level
    ``if`` / ``try`` / ``with`` / ``for``), or None when that cannot be known from them (``import *``, a module-level
    ``__getattr__``; the caller also gives up on a source that writes ``globals()``, calls ``setattr`` or ``exec``)."""
    import ast

    names: set = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
            continue
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            targets = [node.target]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            targets = [item.optional_vars for item in node.items if item.optional_vars is not None]
        else:
            targets = []
        for target in targets:
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        names.update(n.target.id for n in ast.walk(node) if isinstance(n, ast.NamedExpr)
                     and isinstance(n.target, ast.Name))
        inner = [*_statements(node, "body"), *_statements(node, "orelse"), *_statements(node, "finalbody"),
                 *(n for handler in _statements(node, "handlers") for n in handler.body)]
        found = _top_level_names(inner) if inner else set()
        if found is None:
            return None
        names |= found
    return names


def _statements(node, field: str) -> list:
    value = getattr(node, field, None)
    return value if isinstance(value, list) else []


def check_factory_builds_cache(spec: CacheSpec, config) -> None:
    """Build ``spec`` once for ``config`` (``CacheSpec.plan_build``: a factory naming ``model`` gets a weightless
    meta-device model) and make sure the result is a ``transformers.Cache`` or a ``(Cache, context manager)`` pair
    (``unpack_factory_result``). A factory that cannot be built this way (it computes with the model's weights) has
    its result checked when its items build it (a wrong one fails them).

    Raises:
        SpecError: the factory requires an argument kvconform never passes (``required_unknown_arguments``), or
            returned something else.
    (An exception raised by the factory itself is left to the items: it fails them, not the session.)
    """
    missing = required_unknown_arguments(spec.factory)
    if missing:
        raise SpecError(
            f"{spec.source if spec.source != 'python' else spec.name!r}: {spec.name} requires "
            f"{', '.join(repr(m) for m in missing)}, which kvconform cannot pass (it passes only those of "
            f"{', '.join(CONSTRUCTION_KWARGS)} that the signature accepts); hand kvconform a factory instead, e.g. "
            f"def make_{spec.name.lower()}(config): return {spec.name}(config=config, {missing[0]}=...)")
    try:
        spec.plan_build(config)
    except SubjectBuildError as exc:
        if isinstance(exc.cause, FactoryResultError):
            raise SpecError(f"{spec.source!r}: {exc.cause}") from None
    except Exception:  # noqa: BLE001 - reported per item
        return


def as_cache_spec(obj, source: str = "python") -> CacheSpec:
    """Turn what a user hands over into a ``CacheSpec``: a ``CacheSpec`` (as is), a ``"module:attr"`` string, a
    ``transformers.Cache`` subclass or a factory (named after ``__name__``).

    Raises:
        SpecError: anything else, or a string that does not resolve (see ``resolve_cache_spec``).
    """
    if isinstance(obj, CacheSpec):
        return obj
    if isinstance(obj, str):
        return resolve_cache_spec(obj)
    from transformers import Cache

    name = getattr(obj, "__name__", None)
    if inspect.isclass(obj) and not issubclass(obj, Cache):
        raise SpecError(f"{name}: a class but not a transformers.Cache subclass{_not_a_cache_hint(obj)}")
    if not callable(obj) or not name or not name.isidentifier():
        raise SpecError(f"{obj!r}: not a CacheSpec, a 'module:attr' string, a Cache subclass or a named factory")
    return CacheSpec(name, obj, source=source, **_declared(obj, name))
