"""Power on the subject's own cache: mutants made at the cache's interface (issue 38, part 3).

A **mutant** is the subject's own cache class with one planted bug, made without reading the cache's internals: the
cache the subject's factory builds gets a class of its own (a subclass created here, assigned to the instance's
``__class__``, so ``deepcopy`` and ``isinstance`` keep working) whose public methods call the subject's and change
what they do at the interface — ``update()`` returns one stale or one dropped token, a batch op ignores its indices,
``reset`` / ``crop`` do nothing, every update's keys are also kept in a hidden list on the cache, an evicting cache's
declared held positions are shifted by one. A model adapter's cache (``kvconform.scratch``) gets the same on its
``select`` / ``crop`` / ``reset`` and on its cache object.

``MUTANTS`` is the one table: each ``Mutant`` names what the subject must have for the mutant to exist (a declared
capability, a method of the factory), the ops of a case that exercise it, the families expected to kill it, and how
it is applied. ``mutant_spec`` makes the subject's ``CacheSpec`` build mutated caches (every instance, as a bug of the
class would: a fresh instance a check compares with is mutated too). ``candidates`` says which mutants an item may
run. The run itself (``kvconform.checks.run_power``) re-runs the item's check on each mutant; an item that passes on
the subject *and* on a mutant its family should kill is blind for that subject.

Torch is imported where a mutant runs, never at import.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

from kvconform.ops import op_names
from kvconform.run_options import POWER_MODES as MODES  # noqa: F401 - the one list (re-exported)
"""``--kvconform-power``: no power pass; the sampled pass (the default: subjects that are not kvconform's own, the
first ``SAMPLE`` candidate items per subject × family × mutant, by estimated cost then item id, until one kills it);
the full pass (every passing candidate item, built-in subjects too)."""

SAMPLE = 2
"""Candidate items per subject × family × mutant the sampled pass runs a mutant on (fewer once one has killed it)."""

KILLED, SURVIVED, ERROR, UNUSED = "killed", "survived", "error", "not run"
"""A mutant's result on one item (``metrics["power"]``): the check failed on it (a ``ConformanceError`` or the
subject's own raise: a kill); it passed (the item is blind to it); kvconform's own code failed on it or the mutant
could not be made for this cache (no verdict); the check skipped on it."""

TOKEN_OPS = ("prefill", "chunk", "decode")
_SKIP_FAMILIES = ("speed", "compile", "coverage", "fuzz")
"""Families no mutant is run in: timing budgets, compilation and transformers' cache tables cannot see a wrong
token, and they are the costliest items; the fuzzer leaves out every op that fails on its own (a single op's bug is
its family's finding), so it is not expected to kill an op mutant."""


@dataclass(frozen=True)
class Mutant:
    """One mutant kind of ``MUTANTS``.

    Attributes:
        name: its name in the power table.
        what: one line saying the planted bug.
        needs: the subject capabilities it uses (``CacheSpec.capabilities``): the one it mutates, and one it calls.
        method: a method the subject's factory must have for it to exist (``kvconform_held``), or None.
        ops: the case ops that exercise it (an item whose check reads its case's ops is a candidate only when the
            case has one of them); ``()``: any case.
        families: the check families expected to kill it (the power table's rows for it).
        adapter: whether it exists for a model adapter's cache (``kvconform.scratch``), and ``transformers``
            whether for a ``transformers.Cache`` that is not one.
        apply: ``apply(cls, adapter) -> dict`` of the methods the mutant class overrides (``cls`` the cache's
            class; ``adapter`` whether it is a model adapter's ``ScratchCache``).
        unseen_by: checks of those families that do not judge what the mutant changes (bytes held, a refusal),
            so a pass there is no evidence of blindness: they do not run it.
    """

    name: str
    what: str
    needs: tuple
    method: str | None
    ops: tuple
    families: tuple
    adapter: bool
    transformers: bool
    apply: Callable
    unseen_by: tuple = ()


# ---------------------------------------------------------------------------------------------------- the mutants
def _touch(cache) -> None:
    """Count one call in which the mutant changed what the cache did (``Touched``: a mutant the check never made
    live is no evidence either way)."""
    type(cache).kvconform_touched.count += 1


class Touched:
    """How many times the caches of one mutant run changed what the subject would have done (shared by every cache
    that run builds)."""

    def __init__(self):
        self.count = 0


def _decode_slot(keys, new_key):
    """The index, per row, of the slot of ``keys`` ``[B, H, L, D]`` that holds ``new_key`` ``[B, H, 1, D]`` (the
    token just written): the nearest slot, so a cache storing keys in another dtype still finds it."""
    diff = (keys.float() - new_key.float()).abs().sum(dim=(1, 3))  # [B, L]
    return diff.argmin(dim=-1)


def _stale(cls, adapter):
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = cls.update(self, key_states, value_states, layer_idx, *args, **kwargs)
        memory = self.__dict__.setdefault("_power_previous", {})
        previous = memory.get(layer_idx)
        memory[layer_idx] = (key_states[..., -1:, :].detach().clone(), value_states[..., -1:, :].detach().clone())
        if key_states.shape[-2] != 1 or previous is None or keys.shape[-2] < 2 \
                or previous[0].shape != key_states.shape:
            return keys, values
        _touch(self)
        slot = _decode_slot(keys, key_states)
        keys, values = keys.clone(), values.clone()
        for row in range(keys.shape[0]):  # the newest token's slot returns the previous decode step's token
            keys[row, :, int(slot[row])] = previous[0][row, :, 0].to(keys.dtype)
            values[row, :, int(slot[row])] = previous[1][row, :, 0].to(values.dtype)
        return keys, values

    return {"update": update}


def _dropped(cls, adapter):
    if adapter:
        def feed(self, net, ids, mask):
            before = copy.deepcopy(self) if ids.shape[1] == 1 and self.held >= 2 else None
            logits = cls.feed(self, net, ids, mask)
            if before is not None:  # the cache object keeps its state from before the token: the token is dropped
                _touch(self)
                self.state = before.state
            return logits

        return {"feed": feed}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = cls.update(self, key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[-2] != 1 or keys.shape[-2] < 2:
            return keys, values
        _touch(self)
        return keys[..., 1:, :], values[..., 1:, :]  # the oldest held token is missing from what update returns

    return {"update": update}


def _reorder_ignored(cls, adapter):
    def reorder_cache(self, beam_idx):
        _touch(self)

    return {"reorder_cache": reorder_cache}


def _select_ignored(cls, adapter):
    def batch_select_indices(self, indices):
        import torch

        n = len(indices)
        _touch(self)
        return cls.batch_select_indices(self, torch.arange(n, device=getattr(indices, "device", None)))

    return {"batch_select_indices": batch_select_indices}


def _repeat_ignored(cls, adapter):
    def batch_repeat_interleave(self, repeats):
        import torch

        rows = getattr(self, "batch", None) if adapter else self.__dict__.get("_power_rows")
        out = cls.batch_repeat_interleave(self, repeats)
        r = int(repeats)
        if rows is None or rows < 2 or r < 2:
            return out
        # rows tiled ([b0, b1, b0, b1]) instead of interleaved ([b0, b0, b1, b1])
        _touch(self)
        perm = torch.tensor([(j % rows) * r + j // rows for j in range(rows * r)])
        cls.reorder_cache(self, perm.to(self.__dict__.get("_power_device", "cpu")))
        self.__dict__["_power_rows"] = rows * r
        return out

    if adapter:
        return {"batch_repeat_interleave": batch_repeat_interleave}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # the rows the model feeds: what the interface says of the batch size (the next repeat tiles that many)
        self.__dict__["_power_rows"] = int(key_states.shape[0])
        self.__dict__["_power_device"] = key_states.device
        return cls.update(self, key_states, value_states, layer_idx, *args, **kwargs)

    return {"batch_repeat_interleave": batch_repeat_interleave, "update": update}


def _reset_noop(cls, adapter):
    def reset(self):
        _touch(self)

    return {"reset": reset}


def _crop_noop(cls, adapter):
    def crop(self, max_length):
        _touch(self)

    return {"crop": crop}


def _leak(cls, adapter):
    if adapter:
        def feed(self, net, ids, mask):
            logits = cls.feed(self, net, ids, mask)
            _touch(self)
            self.__dict__.setdefault("_history", []).append(copy.deepcopy(self).state)
            return logits

        return {"feed": feed}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = cls.update(self, key_states, value_states, layer_idx, *args, **kwargs)
        _touch(self)
        self.__dict__.setdefault("_history", []).append(key_states.detach().clone())
        return out

    return {"update": update}


def _held_shift(cls, adapter):
    def kvconform_held(self, *args, **kwargs):
        held = cls.kvconform_held(self, *args, **kwargs)
        _touch(self)
        if isinstance(held, dict) and "positions" in held:
            return {**held, "positions": _plus_one(held["positions"])}
        if isinstance(held, (tuple, list)) and len(held) == 2:
            shifted = (held[0], _plus_one(held[1]))
            return list(shifted) if isinstance(held, list) else shifted
        return held

    return {"kvconform_held": kvconform_held}


def _plus_one(positions):
    return [p + 1 for p in positions] if isinstance(positions, list) else positions + 1


_FEEDING = ("logits", "crop", "prefix", "batch", "lifecycle", "generate", "quality")
"""The families that judge the logits of decode steps: each should see a wrong token. (Not ``fuzz``: its programs
leave out what a single op's family already finds, and each of its items is a dozen programs; not ``contract``,
which judges lengths and the API, not values: it is expected to kill a dropped token only; not ``speculative``,
which compares greedy tokens, not logits — a dropped oldest token left 12 greedy tokens of the tiny llama unchanged
— and is expected to kill a crop that does nothing.)"""
_BYTES_OR_REFUSALS = ("check_compression_real", "check_memory_bound", "check_deepcopy_refused")
"""Checks of the logit-judging families that judge bytes held or a refusal, not the logits: a wrong token returned by
``update()`` changes neither."""
MUTANTS: tuple[Mutant, ...] = (
    Mutant("stale_token", "update() returns the previous decode step's token in the newest token's slot", (), None,
           ("decode",), _FEEDING, False, True, _stale, _BYTES_OR_REFUSALS),
    Mutant("dropped_token", "update() returns the keys/values without the oldest held token (a model adapter's "
           "cache object keeps its state from before each decode token)", (), None,
           ("decode",), (*_FEEDING, "contract"), True, True, _dropped, _BYTES_OR_REFUSALS),
    Mutant("reorder_ignored", "reorder_cache() ignores its indices (rows keep their order)", ("reorder",), None,
           op_names(rows="permute"), ("batch", "generate"), True, True, _reorder_ignored),
    Mutant("select_ignored", "batch_select_indices() ignores its indices (keeps the first rows)", ("batch_select",),
           None, ("select",), ("batch",), True, True, _select_ignored),
    Mutant("repeat_ignored", "batch_repeat_interleave() tiles the rows instead of interleaving them",
           ("batch_repeat", "reorder"), None, ("repeat",), ("batch", "generate"), True, True,
           _repeat_ignored),
    Mutant("reset_noop", "reset() does nothing", ("reset",), None, ("reset",), ("lifecycle", "contract"),
           True, True, _reset_noop),
    Mutant("crop_noop", "crop() does nothing", ("crop",), None, ("crop",),
           ("crop", "speculative", "prefix", "contract"), True, True, _crop_noop),
    Mutant("hidden_leak", "each update's keys (a model adapter: each state) are also kept in a hidden list on the "
           "cache object", (), None, (), ("memory",), True, True, _leak),
    Mutant("held_shift", "kvconform_held() gives every held position shifted by one", (), "kvconform_held", (),
           ("contract",), False, True, _held_shift),
)
BY_NAME = {m.name: m for m in MUTANTS}


# ---------------------------------------------------------------------------------------------------- applying
def is_adapter_subject(spec) -> bool:
    """Whether ``spec`` is a model adapter's cache (``kvconform.scratch``: its source says so)."""
    return str(getattr(spec, "source", "")).startswith("model adapter ")


def is_own(spec) -> bool:
    """Whether ``spec`` is kvconform's own built-in subject (the sampled pass is for the others)."""
    return getattr(spec, "source", "builtin") == "builtin"


def exists_for(mutant: Mutant, spec) -> bool:
    """Whether ``mutant`` can be made for subject ``spec``: its capability declared, its method on the factory, its
    cache kind (a model adapter's cache or a ``transformers.Cache``)."""
    if not set(mutant.needs) <= set(spec.capabilities):
        return False
    if mutant.method is not None and not callable(getattr(spec.factory, mutant.method, None)):
        return False
    return mutant.adapter if is_adapter_subject(spec) else mutant.transformers


def candidates(spec, check, case) -> list[Mutant]:
    """The mutants an item of ``check`` (a ``CheckInfo``) on ``case`` may run for ``spec``: those that exist for the
    subject, whose expected families include the check's, and — when the check drives its case's ops — whose ops
    the case has."""
    if check.family in _SKIP_FAMILIES or check.timed:
        return []
    rule = check.ops
    own_driver = rule is None or not rule.reads
    names = {op.name for op in case.ops}
    out = []
    for mutant in MUTANTS:
        if check.family not in mutant.families or check.name in mutant.unseen_by or not exists_for(mutant, spec):
            continue
        if mutant.ops and not own_driver and not names & set(mutant.ops):
            continue
        out.append(mutant)
    return out


class MutantNotMade(Exception):
    """The mutant could not be made for this cache (its class refuses a subclass: ``__slots__``, a C type)."""


def mutate(cache, mutant: Mutant, adapter: bool, touched: Touched | None = None):
    """Make ``cache`` (a built subject cache) an instance of a mutant class of its own class; returns it.

    Raises:
        MutantNotMade: the class cannot be subclassed or assigned (the mutant has no verdict here).
    """
    cls = type(cache)
    try:
        methods = mutant.apply(cls, adapter)
        sub = type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                         "kvconform_mutant": mutant.name,
                                         "kvconform_touched": touched if touched is not None else Touched()})
        cache.__class__ = sub
    except TypeError as exc:
        raise MutantNotMade(f"{cls.__name__}: {exc}") from None
    return cache


def mutant_spec(spec, mutant: Mutant):
    """A copy of ``spec`` (a ``CacheSpec``) whose every built cache is mutated by ``mutant``; same name and fields.
    Its ``kvconform_touched`` (a ``Touched``) counts the calls in which a mutated cache did something else than the
    subject's would have."""
    mutated = copy.copy(spec)
    adapter = is_adapter_subject(spec)
    touched = Touched()

    def build_one(**available):
        return mutate(spec.build_one(**available), mutant, adapter, touched)

    object.__setattr__(mutated, "build_one", build_one)
    object.__setattr__(mutated, "kvconform_touched", touched)
    return mutated
