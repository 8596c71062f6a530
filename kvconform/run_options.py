"""The options of one run as one validated value, ``RunOptions``: built from the option table
(``options.run_options``, under pytest) or from keyword arguments (``check_cache``, ``parametrize_with_checks``,
``session.build_session``), and carried as one field by the session (``KVSession.options``) and the check context
(``CheckContext.options``). Torch-free, and below every module that reads it (the option table, ``options.py``, is
the plugin's layer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvconform.outcomes import UsageError

POWER_MODES = ("off", "sampled", "full")
"""``--kvconform-power``'s values (``checks._power.MODES``)."""


@dataclass(frozen=True)
class RunOptions:
    """The options of one run, validated where they are made (a bad value raises at once, naming its flag).

    Attributes:
        strict: ``--kvconform-strict``: known upstream faults fail instead of xfail.
        full: ``--kvconform-full``: the heavier tier (checks may use their heavier profile).
        device: ``--kvconform-device``: the torch device of the models under test: ``cpu``, ``cuda`` or ``cuda:N``
            (whether CUDA is there is judged by the plugin's ``check_usage``; a plan for CUDA can be made without).
        timeout: ``--kvconform-timeout``: seconds an item may run under pytest (0: no limit).
        fuzz_seed: ``--kvconform-fuzz-seed`` resolved (``random`` drawn): mixed into the fuzz family's fixed seeds;
            None: the fixed seeds.
        power: ``--kvconform-power``: ``off``, ``sampled`` or ``full`` (``POWER_MODES``).
        trust_remote_code: ``--kvconform-trust-remote-code``: run model repositories' own code.
        shard: ``--kvconform-shard`` resolved: ``"I/N"`` or None.
        reproduce_args: the run's own flags (already shell-quoted) that a failure's ``reproduce:`` line repeats.
        flags: every option of the table by its short name (``--kvconform-foo-bar`` → ``foo_bar``) as the plugin
            read it, ``(name, value)`` pairs: what ``get`` reads for a flag that has no field here.

    Raises:
        UsageError: a value out of range, naming the flag, the value and what it must be.
    """

    strict: bool = False
    full: bool = False
    device: str = "cpu"
    timeout: float = 300.0
    fuzz_seed: int | None = None
    power: str = "sampled"
    trust_remote_code: bool = False
    shard: str | None = None
    reproduce_args: tuple[str, ...] = ()
    flags: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        device = self.device
        kind, _, index = device.partition(":") if isinstance(device, str) else ("", "", "")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise UsageError(f"--kvconform-device {device!r}: kvconform runs on cpu, cuda or cuda:N")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or self.timeout < 0:
            raise UsageError(f"--kvconform-timeout {self.timeout!r}: must be a number ≥ 0 (0 disables the timeout)")
        if self.fuzz_seed is not None and (isinstance(self.fuzz_seed, bool) or not isinstance(self.fuzz_seed, int)
                                           or self.fuzz_seed < 0):
            raise UsageError(f"--kvconform-fuzz-seed {self.fuzz_seed!r}: an integer ≥ 0 or 'random'")
        if self.power not in POWER_MODES:
            raise UsageError(f"--kvconform-power {self.power!r}: must be one of {', '.join(POWER_MODES)} (sampled: "
                             f"the default; full: every candidate item, built-in subjects too)")

    @classmethod
    def of(cls, options: RunOptions | None = None, **changes: Any) -> RunOptions:
        """``options`` (default: the defaults) with ``changes`` by keyword (a field name), validated as the command
        line is: the one way ``check_cache``, ``parametrize_with_checks`` and ``build_session`` take options.

        Raises:
            UsageError: an unknown keyword (with a "did you mean") or a bad value.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        for name in changes:
            if name not in names:
                import difflib

                close = difflib.get_close_matches(name, names, n=1)
                raise UsageError(f"unknown run option {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                                 + f" (run options: {', '.join(names)})")
        return dataclasses.replace(options or cls(), **changes)

    def get(self, name: str, default: Any = None) -> Any:
        """The value of the option ``name`` (its short name: ``--kvconform-foo-bar`` → ``"foo_bar"``) in this run:
        its field here, else ``flags`` (``default`` when the run has no such flag, e.g. outside pytest). A check
        reads a flag of its own as ``ctx.options.get("foo_bar")``: its ``Option`` entry is all the flag needs."""
        if name != "flags" and name in self.__dataclass_fields__:
            return getattr(self, name)
        return dict(self.flags).get(name, default)
