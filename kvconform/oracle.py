"""The oracle: uncached float64 logits, the noise floor, and the tolerance rule (ARCHITECTURE.md, "Oracle and
tolerance").

* oracle logits: ``use_cache=False`` forward of the same weights on the same full token sequence, in float64 on
  CPU. By causality the logits at position ``t`` depend only on tokens ``≤ t``, so one oracle forward of a
  sequence serves every step that produced a prefix of it.
* noise floor: ``max|uncached forward at the case dtype − oracle|`` over the compared positions. It is what a
  perfect cache cannot beat, because the subject computes in the case dtype too.
* tolerance: a subject passes when ``max|subject − oracle| ≤ max(k · floor, abs_min)``. On transformers 5.24 in
  fp32, exact caches sit at 1e-7 (attention) to 2e-6 (Mamba) while real faults start at 1e-4 (Jamba chunked
  continuation) and 2e-3 (position offset) (measured on the zoo) so ``k = 10`` and ``abs_min = 2e-5`` separate
  them with an order of magnitude on each side.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, replace
from typing import Callable

from kvconform import compat

DEFAULT_FACTOR = 10.0
DEFAULT_ABS_MIN = 2e-5
HALF_FACTOR = 5.0


@dataclass(frozen=True)
class Dtype:
    """One dtype a case may name (``DTYPES``, the one table of them: case files, tolerances, ids, reports).

    Attributes:
        name: the case file's and torch's name (``"bfloat16"``; ``torch.<name>``).
        short: the short name of headlines and failure lines (``"bf16"``).
        tolerance: ``(k, abs_min)`` of the oracle comparison at this dtype (``dtype_tolerance``).
        exact_integers: the largest n such that every integer 0..n is exact in the dtype (2 ** significand bits,
            IEEE 754 / bfloat16): a count kept in this dtype stalls there.
    """

    name: str
    short: str
    tolerance: tuple
    exact_integers: int

    @property
    def torch(self):
        """The ``torch.dtype`` (imports torch)."""
        import torch

        return getattr(torch, self.name)


DTYPES: dict[str, Dtype] = {d.name: d for d in (
    Dtype("float32", "fp32", (DEFAULT_FACTOR, DEFAULT_ABS_MIN), 2 ** 24),
    Dtype("float64", "fp64", (DEFAULT_FACTOR, DEFAULT_ABS_MIN), 2 ** 53),
    Dtype("bfloat16", "bf16", (HALF_FACTOR, 3e-2), 2 ** 8),
    Dtype("float16", "fp16", (HALF_FACTOR, 4e-3), 2 ** 11),
)}
"""Every dtype a case may name, in the order reports list them. Tolerances (README "Low precision: bf16 and fp16" has
the measurements): float32 (and float64): k = 10, abs_min = 2e-5. bfloat16 / float16 (transformers 5.24, the 14 zoo
models, ReferenceCache / DynamicCache / StaticCache, left-padded decode and chunk cases): the uncached forward is
1.6e-2…4.4e-2 (bf16) and 1.5e-3…5.0e-3 (fp16) from the float64 oracle, exact caches sit at ≤ 1.96× that floor
(mamba, bf16) and the bundled faults that show at these dtypes at ≥ 11.7× (KeysAt2BitsCache, bf16); k = 5 leaves
2.5× above the exact caches and 2.3× below the faults. abs_min (≈ 2× the smallest floor measured) bounds a position
whose uncached forward rounds onto the oracle."""

DTYPE_TOLERANCE = {name: d.tolerance for name, d in DTYPES.items()}
"""``(k, abs_min)`` per case dtype, read from ``DTYPES``."""


def short_dtype(name: str) -> str:
    """The short name of a dtype name (``"bfloat16"`` → ``"bf16"``; ``DTYPES``); an unknown name as it is."""
    d = DTYPES.get(name)
    return d.short if d is not None else name


DRIFT_MAX = 1e-4
"""The largest oracle drift taken for float32 rounding (``Tolerance.oracle_drift``): the smallest real fault measured
on the zoo (Jamba's chunked continuation) starts here, so a larger drift is a fault of the model's cached path."""


def dtype_tolerance(dtype: str) -> tuple[float, float]:
    """``(k, abs_min)`` of a case dtype name (``"float32"``, ``"bfloat16"``, ...; ``DTYPES``)."""
    return DTYPE_TOLERANCE.get(dtype, (DEFAULT_FACTOR, DEFAULT_ABS_MIN))


@dataclass(frozen=True)
class Tolerance:
    """``bound(floor) = max(factor · max(floor, oracle_drift), abs_min)`` (logit units).

    ``oracle_drift``: for a model whose float64 forward computes in float32 inside, what its oracle cannot resolve
    between its cached and uncached paths (``checks.oracle_drift``, measured); 0.0 for every other model.
    ``drift_source``: measures it when first needed (``compare_logits``: only for a step that fails the bound without
    it by no more than ``factor · DRIFT_MAX``, since a float64 forward of some models takes seconds)."""

    factor: float = DEFAULT_FACTOR
    abs_min: float = DEFAULT_ABS_MIN
    oracle_drift: float = 0.0
    drift_source: Callable[[], float] | None = field(default=None, compare=False, repr=False)

    def bound(self, floor: float) -> float:
        return max(self.factor * max(floor, self.oracle_drift), self.abs_min)

    def describe(self, floor: float) -> str:
        if self.oracle_drift > floor and self.factor * self.oracle_drift >= self.abs_min:
            return (f"{self.factor:g} × the oracle's own drift {self.oracle_drift:.1e} (its float64 forward computes "
                    f"in float32 inside); noise floor {floor:.1e}")
        if self.factor * floor >= self.abs_min:
            return f"{self.factor:g} × noise floor {floor:.1e}"
        return f"abs_min {self.abs_min:.1e}; noise floor {floor:.1e}"


@dataclass(frozen=True)
class Comparison:
    """Result of comparing subject logits with the oracle on one step.

    ``max_abs`` is ``inf`` when the subject produced NaN/inf. ``worst`` is ``(batch_row, offset_in_step)``.
    """

    max_abs: float
    floor: float
    tol: float
    worst: tuple

    @property
    def passed(self) -> bool:
        return self.max_abs <= self.tol


def compare_logits(observed, oracle, uncached, tolerance: Tolerance) -> Comparison:
    """Compare ``observed`` with ``oracle``, the noise floor taken from ``uncached``.

    Args:
        observed: subject logits ``[B, k, V]`` (any float dtype).
        oracle: float64 oracle logits ``[B, k, V]``.
        uncached: case-dtype uncached logits ``[B, k, V]``.

    Raises:
        ValueError: the shapes differ (the message names both).
    """
    import torch

    if tuple(observed.shape) != tuple(oracle.shape):
        raise ValueError(f"logits shape {tuple(observed.shape)}, but should be {tuple(oracle.shape)}")
    diff = (observed.detach().to("cpu", torch.float64) - oracle).abs()
    floor = float((uncached.detach().to("cpu", torch.float64) - oracle).abs().max())
    if not torch.isfinite(diff).all():
        bad = (~torch.isfinite(diff)).nonzero()[0].tolist()
        return Comparison(math.inf, floor, tolerance.bound(floor), (bad[0], bad[1]))
    per_pos = diff.amax(dim=-1)  # [B, k]
    flat = int(per_pos.argmax())
    worst = (flat // per_pos.shape[1], flat % per_pos.shape[1])
    max_abs = float(per_pos.max())
    source = tolerance.drift_source
    if source is not None and tolerance.bound(floor) < max_abs <= tolerance.factor * DRIFT_MAX:
        tolerance = replace(tolerance, oracle_drift=source(), drift_source=None)  # a float32-bound oracle?
    return Comparison(max_abs, floor, tolerance.bound(floor), worst)


class Oracle:
    """Uncached logits of one model, memoised per token sequence.

    Args:
        zoo_model: a ``kvconform.zoo.ZooModel``.

    ``logits(...)`` returns float64 ``[B, T, V]`` from the float64 copy of the weights; ``uncached(...)`` returns
    the same forward at the case dtype (for the noise floor), converted to float64.
    """

    def __init__(self, zoo_model):
        self.zoo_model = zoo_model
        self._memo: dict = {}
        self._disk = DiskMemo.for_model(zoo_model)

    @staticmethod
    def _key(kind, tokens, attention_mask, encoder_ids):
        parts = [kind, tuple(tokens.shape), tokens.cpu().numpy().tobytes()]
        for extra in (attention_mask, encoder_ids):
            parts.append(None if extra is None else extra.cpu().numpy().tobytes())
        return tuple(parts)

    def _forward(self, model, tokens, attention_mask, encoder_ids):
        import torch

        device = next(model.parameters()).device
        kwargs = {"use_cache": False}
        if self.zoo_model.is_encoder_decoder:
            kwargs.update(compat.encoder_kwargs(model, encoder_ids), decoder_input_ids=tokens.to(device))
        else:
            kwargs["input_ids"] = tokens.to(device)
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask.to(device)
                if compat.accepts_position_ids(model):  # as every cached forward gets them (_drive.forward)
                    kwargs["position_ids"] = padded_position_ids(attention_mask).to(device)
        with torch.no_grad():
            return model(**kwargs).logits.detach().to("cpu", torch.float64)

    def _memoised(self, kind, model_fn, tokens, attention_mask, encoder_ids):
        key = self._key(kind, tokens, attention_mask, encoder_ids)
        if key not in self._memo:
            model = model_fn()
            found = self._disk.get(model, key, tokens.shape) if self._disk is not None else None
            if found is None:
                found = self._forward(model, tokens, attention_mask, encoder_ids)
                if self._disk is not None:
                    self._disk.put(model, key, found)
            self._memo[key] = found
        return self._memo[key]

    def logits(self, tokens, attention_mask=None, encoder_ids=None):
        """float64 oracle logits ``[B, T, V]`` of ``tokens`` ``[B, T]`` (int64)."""
        return self._memoised("oracle", self.zoo_model.oracle_model, tokens, attention_mask, encoder_ids)

    def uncached(self, tokens, attention_mask=None, encoder_ids=None):
        """Case-dtype uncached logits ``[B, T, V]`` (as float64) — the noise-floor reference."""
        return self._memoised("uncached", lambda: self.zoo_model.model, tokens, attention_mask, encoder_ids)

    def left_padding_gap(self, pad_token: int = 0) -> float | None:
        """How far the model's own float64 uncached forward puts a left-padded row from the same row alone: 6
        tokens after 2 pad tokens, with the attention mask (and ``position_ids = cumsum(mask) − 1`` where the model
        takes them counted from 0: ``compat.accepts_position_ids``), as every padded forward gets them, against the
        6 tokens alone, over the 6 real positions (``max|Δlogit|``). None where they agree (relative 1e-6), and for
        an encoder-decoder model (its decoder is never left-padded) or a forward whose padded row is not finite
        (gemma2's eager float32 softmax of a fully masked row): no verdict, as before.

        A model whose positions come from the slot rather than from ``position_ids`` (learned absolute positions it
        offsets by itself — BART's ``+ 2``, RoBERTa's ``padding_idx + 1`` — or a forward that takes none) gives a
        left-padded row other logits than the row alone, whatever the cache: a left-padded batch has no unpadded
        equivalent there. Measured once per oracle (a model in a process); two forwards of 8 tokens."""
        import torch

        if self.zoo_model.is_encoder_decoder:
            return None
        if "left_padding_gap" not in self._memo:
            vocab = int(self.zoo_model.vocab_size)
            toks = (torch.arange(3, 9) % vocab).unsqueeze(0)
            padded = torch.cat([torch.full((1, 2), pad_token, dtype=torch.long), toks], dim=1)
            mask = torch.tensor([[0, 0] + [1] * 6])
            try:
                alone = self.logits(toks)
                in_batch = self.logits(padded, attention_mask=mask)[:, 2:]
                gap = float((alone - in_batch).abs().max())
                scale = max(1.0, float(alone.abs().max()))
            except Exception:  # noqa: BLE001 - not runnable like this: its items decide, as before
                gap, scale = 0.0, 1.0
            self._memo["left_padding_gap"] = gap if math.isfinite(gap) and gap > 1e-6 * scale else None
        return self._memo["left_padding_gap"]


CACHE_ENV = "KVCONFORM_CACHE"
"""``KVCONFORM_CACHE=off`` (or ``0`` / ``false`` / ``no``): no oracle forward is read from or written to the disk
(``DiskMemo``); on by default. Measured on the default run (2-core machine, ``farm-bench``, medians of 5 paired runs):
a second run with the cache 25.9 s wall / 51.0 CPU-s, without it 27.2 s / 53.1 CPU-s (-5 % wall, -4 % CPU); the
default run writes ~50 MB. The second run's other saving is torch's own compile cache (the compile item: 20 s cold,
2.8 s warm)."""
CACHE_DIR_ENV = "KVCONFORM_CACHE_DIR"
"""The folder of kvconform's cache between runs (default ``$XDG_CACHE_HOME/kvconform``, else
``~/.cache/kvconform``; never the project's folder)."""
RELEASES_KEPT = 3
"""Release folders (``DiskMemo``) kept under ``oracle/``: the one in use and the two used most recently before it
(e.g. two virtual environments used in turn); older ones are deleted when a run starts."""


def cache_dir() -> str | None:
    """kvconform's cache folder between runs (``$KVCONFORM_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvconform``, else
    ``~/.cache/kvconform``), or None when ``$KVCONFORM_CACHE`` is ``off`` / ``0`` / ``false`` / ``no``."""
    import os

    if os.environ.get(CACHE_ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return None
    folder = os.environ.get(CACHE_DIR_ENV, "").strip()
    if folder:
        return os.path.abspath(os.path.expanduser(folder))
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvconform")


@functools.cache
def release_folder(folder: str) -> str:
    """``folder/oracle/<release>``: the entries of this process's versions (``_versions()`` and
    ``DiskMemo.FORMAT``), ``<release>`` their digest. Once per process: the folder's modification time is set to now
    (it marks the release as used) and the release folders beyond the ``RELEASES_KEPT`` used most recently are
    deleted (another release's entries are never read: their key differs). Any ``OSError`` is ignored (a concurrent
    run deleting the same folder, a read-only disk)."""
    import hashlib
    import shutil
    import time

    root = os.path.join(folder, "oracle")
    release = hashlib.sha256(repr((DiskMemo.FORMAT, *_versions())).encode()).hexdigest()[:16]
    path = os.path.join(root, release)
    try:
        os.makedirs(path, exist_ok=True)
        now = time.time()
        os.utime(path, (now, now))
        others = []
        for name in os.listdir(root):
            other = os.path.join(root, name)
            if name != release and os.path.isdir(other):
                others.append((os.stat(other).st_mtime, other))
        for _, other in sorted(others, reverse=True)[RELEASES_KEPT - 1:]:
            shutil.rmtree(other, ignore_errors=True)
    except OSError:
        pass
    return path


class DiskMemo:
    """The uncached forwards of one zoo model kept between runs: each result an entry file under
    ``cache_dir()/oracle/<release>/`` (``release_folder``: one folder per versions of torch, transformers and
    kvconform, the ``RELEASES_KEPT`` used last kept), named by the SHA-256 of everything that decides it — the
    versions of torch, transformers and kvconform (and the digest of kvconform's own source files), torch's
    intra-op threads, the model's name, class, dtype, device and config, the digest of its weights and buffers at
    the time of the forward (a subject that changed the shared model in place gets other entries), and the
    forward's inputs (``Oracle._key``: kind, token ids, mask, encoder ids).

    An entry is ``sha256(payload) || payload`` (``torch.save`` of the logits): one whose checksum, format or shape
    does not match (a truncated write, a flipped byte, another torch's format) is deleted and the forward runs
    again; it is never trusted. Writes go to a temporary file renamed into place, so concurrent workers never see a
    partial entry. Any ``OSError`` (a read-only or full disk) leaves the run uncached, as before. Only zoo models
    on CPU without an image prefix are kept (a checkpoint's or remote code's forward is not decided by the key).
    Measured on the zoo's llama: a float64 forward of 24-240 tokens 40-280 ms, reading its entry (checksum,
    ``torch.load``) under 1.3 ms; an entry 30-250 KB.
    """

    FORMAT = 2
    """Bumped when the entry layout or the key changes (older entries then never match)."""

    def __init__(self, folder: str, model_key: str):
        self.folder = folder
        self.model_key = model_key
        self._weights: dict = {}

    @classmethod
    def for_model(cls, zoo_model) -> "DiskMemo | None":
        """The disk memo of ``zoo_model``, or None (disabled by ``$KVCONFORM_CACHE``, or not a CPU zoo model
        without an image prefix)."""
        folder = cache_dir()
        if folder is None or getattr(zoo_model, "source", None) != "zoo" or zoo_model.image is not None:
            return None
        try:
            device = next(zoo_model.model.parameters()).device
        except (StopIteration, AttributeError):
            return None
        if device.type != "cpu":
            return None
        import json

        import torch

        model_key = json.dumps([cls.FORMAT, *_versions(), torch.get_num_threads(), zoo_model.name,
                                type(zoo_model.model).__qualname__, str(zoo_model.dtype),
                                zoo_model.config.to_json_string()])
        return cls(release_folder(folder), model_key)

    def _weights_digest(self, model) -> str:
        """SHA-256 of ``model``'s parameters and buffers (names, dtypes, shapes, bytes), as they are now: hashed
        again whenever a tensor is replaced (its storage) or changed in place (torch's ``_version`` counter)."""
        import hashlib

        import torch

        tensors = [*model.named_parameters(), *model.named_buffers()]
        stamp = tuple((name, t.data_ptr(), t._version) for name, t in tensors)
        known = self._weights.get(id(model))
        if known is not None and known[0] == stamp:
            return known[1]
        h = hashlib.sha256()
        for name, t in tensors:
            t = t.detach()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        self._weights[id(model)] = (stamp, h.hexdigest())
        return self._weights[id(model)][1]

    def _path(self, model, key) -> str:
        import hashlib

        h = hashlib.sha256(self.model_key.encode())
        h.update(self._weights_digest(model).encode())
        for part in key:
            h.update(repr(part).encode() if not isinstance(part, bytes) else part)
            h.update(b"|")
        name = h.hexdigest()
        return os.path.join(self.folder, name[:2], name + ".pt")

    def get(self, model, key, shape):
        """The logits stored for ``key`` on ``model`` as it is now (float64, ``[B, T, V]`` with ``shape[:2]`` =
        ``[B, T]``), or None: no entry, or a corrupt / stale one (deleted)."""
        import hashlib
        import io

        import torch

        path = self._path(model, key)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            return None
        try:
            digest, payload = data[:32], data[32:]
            if hashlib.sha256(payload).digest() != digest:
                raise ValueError("checksum")
            logits = torch.load(io.BytesIO(payload), weights_only=True)
            if (not isinstance(logits, torch.Tensor) or logits.dtype != torch.float64 or logits.dim() != 3
                    or tuple(logits.shape[:2]) != tuple(shape[:2])):
                raise ValueError("shape")
            return logits
        except Exception:  # noqa: BLE001 - any unreadable entry is rebuilt, never trusted
            try:
                os.remove(path)
            except OSError:
                pass
            return None

    def put(self, model, key, logits) -> None:
        """Store ``logits`` for ``key`` on ``model`` (atomically; an ``OSError`` is ignored)."""
        import hashlib
        import io
        import tempfile

        import torch

        buf = io.BytesIO()
        torch.save(logits.contiguous(), buf)
        payload = buf.getvalue()
        path = self._path(model, key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                fh.write(hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, path)
        except OSError:
            pass


@functools.cache
def _versions() -> tuple:
    """``(torch, transformers, kvconform, digest of kvconform's .py files)``: the part of every disk memo key that
    is the same for a whole process."""
    import hashlib

    import torch

    import kvconform

    root = os.path.dirname(os.path.abspath(kvconform.__file__))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                with open(os.path.join(folder, f), "rb") as fh:
                    h.update(f.encode() + b"|" + fh.read())
    return torch.__version__, str(compat.transformers_version()), kvconform.__version__, h.hexdigest()


def padded_position_ids(attention_mask):
    """Position ids for a left-padded batch: ``cumsum(mask) − 1``, clamped at 0 (what ``generate`` uses)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
