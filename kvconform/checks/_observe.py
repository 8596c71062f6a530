"""``run_observed``: the interpreter over prefill / chunk / decode ops with a probe after every forward, shared by
``contract.check_encoder_decoder_subcaches`` (sub-cache lengths) and ``memory.check_offloaded_matches`` (GPU
peak)."""

from __future__ import annotations

from kvconform.checks._interpreter import Runner
from kvconform.ops import FORWARD_OPS  # noqa: F401 - the ops run_observed accepts (re-exported)



class AfterForward:
    """Observer calling ``fn(step)`` after every forward of a ``Runner``."""

    def __init__(self, fn):
        self.fn = fn

    def after_forward(self, runner, step):
        """Call the probe with the ``Step`` just recorded."""
        self.fn(step)


def run_observed(ctx, cache, after_step):
    """The case's ops (prefill / chunk / decode only, no padding) on ``cache`` through the interpreter, calling
    ``after_step(step)`` after every forward (probes of the cache's state or of GPU memory); returns the steps and
    sets ``ctx.encoder_ids``.

    Raises:
        SubjectRaised: the subject's exceptions (names the op).
        ValueError: an op other than prefill / chunk / decode.
    """
    runner = Runner(ctx, cache, padding=[], observers=[AfterForward(after_step)], allowed_ops=FORWARD_OPS)
    steps = runner.run(parked=False)
    ctx.encoder_ids = runner.encoder_ids
    return steps
