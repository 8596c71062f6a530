"""Timing for the ``speed`` family: medians of interleaved repeats, a CUDA-synchronised timer, and the
pytest-benchmark adapter.

Why interleaved medians: on a shared machine a single run can stall for tens of milliseconds (measured: 40×
outliers), and the load drifts over seconds. Every *round* therefore runs every target once, in an
order rotated from round to round, and each target is summarised by the median of its rounds. Budgets are
**ratios of targets measured side by side in the same rounds** (the subject against the uncached forward, or the
same subject at two context lengths), so the machine's speed cancels out.

With pytest-benchmark in the suite, the rounds run through ``benchmark.pedantic(...)`` (one pedantic call per
item: the fixture may be used once), so ``--benchmark-*`` options, its table and its JSON see them; the
per-target times are still taken by this module's timer and put in ``benchmark.extra_info``. When benchmarking is
disabled (``--benchmark-disable``, or pytest-benchmark's automatic disabling under xdist) ``measure_interleaved``
raises ``CheckSkipped``: a budget that was not measured must never pass.

Without pytest-benchmark the same rounds run in a plain loop.

Which clock (``clock_for``): on CPU with one torch thread, the **process's CPU time** (``time.process_time``: user +
system time of every thread of the process); on CUDA, or on CPU with several torch threads, the wall clock
(``time.perf_counter``; CUDA work synchronised before it is read). A budget is about the work a cache costs, and on
a shared CPU the wall clock also counts the time the process waited for a core, in whichever round the wait fell.
Measured on a 2-core machine, speed family on llama (medians of the same rounds): with two CPU-bound processes
competing, the wall clock read a token-by-token prefill (``kvconform.testing.faulty_prefill``) at 1.43× the uncached
forward, under its budget of 1.8×, so a real fault passed (CI once passed ``faulty_perf``'s O(context) decode the
same way); by CPU time the same faulty cache measured 2.6-3.1× quiet and 2.3-2.7× under two to four competing
processes, over its budget in 7 runs of 7. What load still changes (caches warmed again after another process ran)
is of the size of the rounds' own spread on a quiet machine (a coefficient of variation of ~0.2 per round for these
millisecond-scale targets, quiet or loaded), which medians of ≥ 5 rounds absorb. Several threads make CPU time the
sum over threads (spin-waiting included), so the wall clock measures them; a CUDA kernel runs off the CPU, so only
the wall clock sees it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvconform.outcomes import CheckSkipped


@dataclass
class Target:
    """One thing to time.

    Attributes:
        name: key of the result (``"subject@1024"``).
        run: ``run(state)``: the timed work; ``state`` is what ``setup`` returned.
        setup: ``setup() -> state``: untimed preparation, run before every round (e.g. build and prefill a cache).
        units: how many units (tokens) one ``run`` processes; reported times are seconds per unit.
    """

    name: str
    run: Callable[[Any], Any]
    setup: Callable[[], Any] = lambda: None
    units: int = 1


@dataclass
class Timing:
    """Per-unit times of one target over the measured rounds (seconds; warm-up rounds excluded)."""

    name: str
    seconds: list = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def minimum(self) -> float:
        return min(self.seconds)

    def describe(self) -> str:
        """``"1.52 ms/token (median of 7; min 1.31)"``."""
        return f"{self.median * 1e3:.2f} ms/token (median of {len(self.seconds)}; min {self.minimum * 1e3:.2f})"


def synchronizer(device) -> Callable[[], None]:
    """A function that waits for ``device``'s queued kernels (``torch.cuda.synchronize``), or does nothing on CPU.

    A CUDA launch returns before the kernel ends, so a timer that does not synchronise measures the launch only.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


@dataclass(frozen=True)
class Clock:
    """The clock of one measurement: ``read()`` returns seconds (a float; only differences mean anything) and
    ``name`` says which clock it is in a failure message (``"process CPU time"``, ``"wall clock
    (perf_counter)"``)."""

    read: Callable[[], float]
    name: str


def clock_for(device, threads: int | None) -> Clock:
    """The clock the speed family reads on ``device`` when torch runs ``threads`` intra-op threads (``None``: the
    current setting, ``torch.get_num_threads()``): process CPU time on CPU with one thread, else the wall clock (see
    the module docstring: why, and what was measured)."""
    import torch

    if torch.device(device).type == "cpu" and (threads if threads else torch.get_num_threads()) == 1:
        return Clock(time.process_time, "process CPU time")
    return Clock(time.perf_counter, "wall clock (perf_counter)")


def benchmark_disabled_reason(benchmark) -> str | None:
    """Why ``benchmark`` (a pytest-benchmark fixture) will not time anything, or None when it will."""
    if benchmark is None or not getattr(benchmark, "disabled", False):
        return None
    return ("benchmarking is disabled (pytest-benchmark: --benchmark-disable, or disabled automatically under "
            "xdist), so this budget was not measured")


def measure_interleaved(targets, repeats: int = 5, warmup: int = 1, device="cpu", benchmark=None,
                        extra_info: dict | None = None, threads: int | None = 1) -> dict[str, Timing]:
    """Time ``targets`` in ``warmup + repeats`` rounds, each round running every target once in rotated order.

    Args:
        targets: list of ``Target``.
        repeats: measured rounds (≥ 5 for a budget: one stall then moves no median).
        warmup: rounds run first and discarded (first-call allocations, lazy initialisation).
        device: the device the targets run on; CUDA work is synchronised before the clock is read.
        benchmark: the pytest-benchmark fixture, or None (plain loop).
        extra_info: added to ``benchmark.extra_info`` (JSON-serialisable).
        threads: ``torch.set_num_threads`` during the measurement (restored afterwards); ``None`` keeps the current
            setting. One thread by default: tiny models on a shared CPU oversubscribe with more and stall. The clock
            follows (``clock_for``): process CPU time on CPU with one thread, the wall clock otherwise.

    Returns:
        ``{target.name: Timing}`` with seconds per unit (of ``clock_for(device, threads)``).

    Raises:
        CheckSkipped: ``benchmark`` is disabled.
        ValueError: ``repeats < 1`` or duplicate target names.
    """
    import torch

    if repeats < 1:
        raise ValueError(f"repeats must be ≥ 1, got {repeats}")
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate target names: {names}")
    reason = benchmark_disabled_reason(benchmark)
    if reason:
        raise CheckSkipped(reason)
    sync = synchronizer(device)
    clock = clock_for(device, threads).read
    results = {t.name: Timing(t.name) for t in targets}
    state = {"round": 0}

    def prepare():
        """Untimed: build every target's state for one round (pytest-benchmark's ``setup``)."""
        return (tuple(t.setup() for t in targets),), {}

    def one_round(states):
        r = state["round"]
        state["round"] += 1
        order = list(range(len(targets)))
        shift = r % len(order)
        order = order[shift:] + order[:shift]
        for i in order:
            target = targets[i]
            sync()
            start = clock()
            target.run(states[i])
            sync()
            elapsed = clock() - start
            if r >= warmup:
                results[target.name].seconds.append(elapsed / target.units)

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        if benchmark is not None:
            benchmark.extra_info.update(extra_info or {})
            benchmark.pedantic(one_round, setup=prepare, rounds=repeats, warmup_rounds=warmup, iterations=1)
        else:
            for _ in range(warmup + repeats):
                args, _ = prepare()
                one_round(*args)
    finally:
        torch.set_num_threads(before)
    if benchmark is not None:
        benchmark.extra_info.update({f"{name} median s/unit": t.median for name, t in results.items()})
    return results


# ------------------------------------------------------------------------------------------ the GPU's floor
BANDWIDTH = {"B200": 8.0e12, "H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
             "GH200": 4.0e12, "A100-SXM4-80GB": 2.04e12, "A100 80GB PCIe": 1.94e12, "A100": 1.55e12,
             "L40S": 0.864e12, "L40": 0.864e12, "L4": 0.3e12, "A10G": 0.6e12, "A10": 0.6e12, "T4": 0.32e12,
             "RTX 4090": 1.0e12, "RTX 3090": 0.94e12}
"""Peak memory bandwidth in bytes/s of GPUs by a part of their name (``torch.cuda.get_device_name``; the first key
contained in the name, in this order: H100 NVL before H100). Vendor datasheets."""

FASTEST_BANDWIDTH = 8.0e12
"""Bytes/s, the fastest GPU memory of ``BANDWIDTH`` (B200's HBM3e): the bandwidth assumed for a GPU not in the
table, or for a plan made without one. A floor computed with it is the lowest any GPU reaches."""

LAUNCH_S = 5e-6
"""Seconds one eager kernel launch costs a decode step on CUDA (launch plus the Python dispatcher: 3-10 µs)."""

KERNELS_PER_LAYER = 12
"""Kernels one decoder layer launches per decode step, at least (two norms, the q/k/v/o and MLP matmuls, rotary,
attention, the cache update, residual adds)."""


def device_bandwidth(name: str | None) -> tuple[float, str]:
    """``(bytes/s, where it came from)`` of the GPU named ``name`` (``BANDWIDTH``), else ``FASTEST_BANDWIDTH``."""
    for key, value in BANDWIDTH.items():
        if name and key in name:
            return value, f"{key} datasheet"
    return FASTEST_BANDWIDTH, "the fastest GPU memory (B200) as an upper bound" + (
        f"; {name} is not in kvconform.timing.BANDWIDTH" if name else "")


def decode_floor_s(bytes_per_token: float, bandwidth: float) -> float:
    """The least time a decode step can take on a GPU: every byte of weights and cache it must read
    (``bytes_per_token``), once, at the memory's peak ``bandwidth`` (bytes/s)."""
    return bytes_per_token / bandwidth


def launch_floor_s(layers: int) -> float:
    """The least time the kernel launches of an eager decode step of ``layers`` decoder layers take
    (``KERNELS_PER_LAYER`` × ``LAUNCH_S`` each)."""
    return layers * KERNELS_PER_LAYER * LAUNCH_S
