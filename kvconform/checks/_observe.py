"""``run_observed``: the manual forward loop (prefill / chunk / decode) with a probe after every forward, shared by
``contract.check_encoder_decoder_subcaches`` (sub-cache lengths) and ``memory.check_offloaded_matches`` (GPU
peak)."""

from __future__ import annotations

from kvconform.checks._engine import SubjectRaised, case_generator, random_tokens


def run_observed(ctx, cache, after_step):
    """``run_ops``' loop (prefill / chunk / decode) calling ``after_step(step)`` after every forward (probes of the
    cache's state or of GPU memory). Raises ``SubjectRaised`` on the subject's exceptions."""
    from kvconform.checks._engine import Step, encoder_ids_for, forward, seq_length

    import torch

    gen = case_generator(ctx.case, ctx.model.name)
    enc = encoder_ids_for(ctx, gen)
    seq = torch.empty(ctx.case.batch, 0, dtype=torch.long)
    steps = []
    for i, op in enumerate(ctx.case.ops):
        sizes = [op.n] if op.name in ("prefill", "chunk") else [1] * op.n if op.name == "decode" else None
        if sizes is None:
            raise ValueError(f"op {op.name!r} is not supported by {ctx.check_name}")
        for s, n in enumerate(sizes):
            label = f"decode {s + 1}" if op.name == "decode" else op.label
            new = random_tokens(gen, ctx.case.batch, n, ctx.model.vocab_size)
            try:
                logits = forward(ctx.model, cache, new, seq.shape[1], ctx.case.position_ids, enc)
            except Exception as exc:  # noqa: BLE001 - the subject's failure
                raise SubjectRaised(label, exc) from exc
            seq = torch.cat([seq, new], dim=1)
            steps.append(Step(len(steps), i, label, seq.shape[1] - n, n, logits, seq.clone(), seq_length(cache)))
            after_step(steps[-1])
    ctx.encoder_ids = enc
    return steps
