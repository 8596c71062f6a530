"""GPU benchmark of transformers' caches on a ~1B-parameter model: the GPU-only part of the speed, memory and compile
families, as one script a person runs on a CUDA machine (the zoo's tiny models are launch-bound on a GPU).

    kvconform-gpu-bench --out gpu_bench.json      # CUDA: ~1.1B Llama-shaped model, bf16 (python -m kvconform.gpu_bench)
    kvconform-gpu-bench --smoke                   # seconds on CPU: every code path at tiny size, no budgets

Without CUDA (and without ``--device cpu`` or ``--smoke``) it prints ``SKIP: requires CUDA ...`` and exits 0: a
hardware-bound measurement is skipped with its reason, never passed. The cache reaches the forward under the
installed transformers' keyword (``compat.cache_kwarg``: ``cache=`` since 5.24, ``past_key_values=`` before).

The model: TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 KV heads, head_dim 64, vocab 32000) with
seeded random weights in bfloat16 — nothing is downloaded. Decode speed does not depend on the weights' values.

Measured (``kvconform.timing.measure_interleaved``: interleaved rounds, medians, ``torch.cuda.synchronize`` around
every target), batch 1:

* per-token decode at each context (default 512 and 2048): ``DynamicCache`` eager, ``StaticCache`` eager,
  ``StaticCache`` + ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs), and the uncached forward;
* the floor: the least time a decode step can take, every weight (the input embedding's one row) and the cache's
  keys and values read once at the memory's peak bandwidth (``timing.device_bandwidth``: the GPU's datasheet; a
  device-to-device copy's bandwidth is measured and reported beside it); ``floor_ratio`` is each cached target's
  measured ms/token over its floor;
* budgets, all relative to this GPU's own floor or targets (none calibrated on a CPU): the compiled static decode
  ≤ ``--max-floor-ratio`` (4) × its floor at each context; each cache's per-token growth from the shortest to the
  longest context ≤ ``--max-growth`` (1.5) × the floor's growth; static+compile ≥ ``--min-speedup-compiled`` (1.5) ×
  DynamicCache eager; zero recompiles after warm-up (``set_stance("fail_on_recompile")``) and zero cudagraph skips
  (``counters["inductor"]["cudagraph_skips"]``). Cached vs uncached is reported, not judged: at batch 1 in eager
  mode a 1.1B model's cached step is bound by its kernel launches;
* memory: ``torch.cuda.memory_allocated`` growth over a prefill + decode (after a warm-up prefill: the cuBLAS
  workspace is allocated on the first matmul) vs ``2·L·B·H_kv·S·D·itemsize`` bytes (a StaticCache holds
  ``max_cache_len``), and the counted tensor bytes (``kvconform.checks.memory.held_bytes``); peak from
  ``max_memory_allocated``. On CPU only the counted bytes (no allocator statistics).

Sections run in the order memory, eager speed, compile, compiled speed (``sections``), and the JSON (``--out``) is
written after each with ``complete: false``, so a run cut at its time limit keeps what it measured. It prints the
report and a summary; exits 1 when a budget is violated on CUDA, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

SIZES = {
    # TinyLlama-1.1B's shape: ~1.1e9 parameters
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096),
    # for a smoke test of this script on any machine
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096),
}


def build_model(size: str, device: str, dtype):
    """A Llama-shaped model of ``SIZES[size]`` with seeded random weights, in ``dtype`` on ``device`` (eval)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SIZES[size], initializer_range=0.02, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _kwargs(model, tokens, start, cache=None):
    """Forward keyword arguments for ``tokens`` (``[batch, k]`` int64) at positions ``start…start+k-1``: uncached
    (``use_cache=False``) when ``cache`` is None, else the cache under the installed transformers' keyword."""
    import torch

    from kvconform.compat import cache_kwarg

    k = tokens.shape[1]
    kw = {"input_ids": tokens, "position_ids": torch.arange(start, start + k, device=tokens.device)[None]}
    if cache is None:
        kw["use_cache"] = False
    else:
        kw.update({cache_kwarg(model): cache, "use_cache": True})
    return kw


def _decode_target(name, model, make_cache, tokens, context, steps, forward=None, cudagraphs=False):
    import torch

    from kvconform.timing import Target

    fwd = forward or model

    def setup():
        cache = make_cache(context + steps)
        with torch.no_grad():
            model(**_kwargs(model, tokens[:, :context], 0, cache))
        return cache

    def run(cache):
        with torch.no_grad():
            for s in range(steps):
                pos = context + s
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                fwd(**_kwargs(model, tokens[:, pos:pos + 1], pos, cache))

    return Target(name, run, setup, units=steps)


def _uncached_target(name, model, tokens, context, steps):
    import torch

    from kvconform.timing import Target

    def run(_):
        with torch.no_grad():
            for s in range(steps):
                model(**_kwargs(model, tokens[:, :context + s + 1], 0))

    return Target(name, run, units=steps)


def _count_recompiles(model, compiled, make_cache, tokens, context, steps, cudagraphs):
    """Decode ``steps`` tokens twice (two fresh caches) under ``fail_on_recompile`` after one warm-up call; return
    ``(recompiles, first guard reason or None)``."""
    import torch

    from kvconform.checks.compile import _first_guard  # imported up front: a rename shows in the smoke test

    misses, reason = 0, None
    for attempt in range(2):
        cache = make_cache(context + steps)
        with torch.no_grad():
            model(**_kwargs(model, tokens[:, :context], 0, cache))
            for s in range(steps):
                pos = context + s
                kw = _kwargs(model, tokens[:, pos:pos + 1], pos, cache)
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                try:
                    compiled(**kw)
                except RuntimeError as exc:
                    if "Detected recompile" not in str(exc):
                        raise
                    misses += 1
                    if reason is None:
                        reason = " ".join(_first_guard(str(exc))).strip()
                    model(**kw)
                if attempt == 0 and s == 0:
                    torch.compiler.set_stance("fail_on_recompile")
    torch.compiler.set_stance("default")
    return misses, reason


def _memory(model, make_cache, tokens, context, steps, device):
    """``(allocated delta, peak delta, counted bytes)`` in bytes of prefilling ``context`` tokens and decoding
    ``steps``; the allocator deltas are None off CUDA."""
    import gc

    import torch

    from kvconform.checks.memory import held_bytes

    on_cuda = str(device).startswith("cuda")
    gc.collect()
    if not on_cuda:
        cache = make_cache(context + steps)
        with torch.no_grad():
            model(**_kwargs(model, tokens[:, :context], 0, cache))
            for s in range(steps):
                model(**_kwargs(model, tokens[:, context + s:context + s + 1], context + s, cache))
        _check_filled(cache, context + steps)
        return None, None, held_bytes(cache)
    # warm-up: cuBLAS allocates its workspace through the caching allocator on the first matmul (MiBs that
    # memory_allocated counts and keeps); a throwaway prefill + decode takes it before the window opens
    warm = make_cache(context + steps)
    with torch.no_grad():
        out = model(**_kwargs(model, tokens[:, :context], 0, warm))
        del out
        out = model(**_kwargs(model, tokens[:, context:context + 1], context, warm))
        del out
    del warm
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache = make_cache(context + steps)
    with torch.no_grad():
        out = model(**_kwargs(model, tokens[:, :context], 0, cache))
        del out
        for s in range(steps):
            pos = context + s
            out = model(**_kwargs(model, tokens[:, pos:pos + 1], pos, cache))
            del out
    gc.collect()
    torch.cuda.synchronize(device)
    _check_filled(cache, context + steps)
    delta = torch.cuda.memory_allocated(device) - base
    peak = torch.cuda.max_memory_allocated(device) - base
    return delta, peak, held_bytes(cache)


def _check_filled(cache, expected: int) -> None:
    """Raise ``RuntimeError`` unless ``cache`` holds ``expected`` tokens: a forward that silently ignored the cache
    keyword (e.g. ``cache=`` on transformers < 5.24) would leave it empty and time an uncached model."""
    held = int(cache.get_seq_length())
    if held != expected:
        raise RuntimeError(f"{type(cache).__name__} holds {held} tokens after the decode, expected {expected}: the "
                           f"forward did not use the cache it was given")


def measured_bandwidth(device, gib: float = 1.0) -> float | None:
    """Bytes/s of a device-to-device copy of ``gib`` GiB (read + written, best of 3), or None off CUDA: what the
    memory delivers here, next to the datasheet's peak (``timing.device_bandwidth``)."""
    import torch

    if not str(device).startswith("cuda"):
        return None
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = None
    for _ in range(4):  # the first copy warms up
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        took = time.perf_counter() - t0
        best = took if best is None else min(best, took)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / best


def floor_bytes_per_token(model, context: int, dtype) -> int:
    """Bytes one decode step at ``context`` tokens (batch 1) must read at least: every weight once (the input
    embedding only its one row) and the cache's keys and values, ``2·L·H_kv·context·D·itemsize``."""
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    embedding = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) \
        - embedding.numel() * embedding.element_size() + embedding.shape[1] * embedding.element_size()
    kv = 2 * text.num_hidden_layers * text.num_key_value_heads * context * head_dim * dtype.itemsize
    return int(weights + kv)


def run_gpu_bench(size="1b", device="cuda", contexts=(512, 2048), steps=32, repeats=7, warmup=2,
                  mode="reduce-overhead", max_growth=1.5, min_speedup_compiled=1.5, max_floor_ratio=4.0,
                  memory_tolerance=0.05, backend="inductor", emit=None) -> dict:
    """Run the benchmark; return the JSON-serialisable report (see the module docstring). Sections run in the order
    memory, eager decode speed, compile (recompiles, then the compiled decode's speed), each reported through
    ``emit(report)`` as it ends (``main`` writes the JSON then), so a run cut short keeps what it measured.

    Args:
        size: a key of ``SIZES`` (``"1b"``: TinyLlama's shape; ``"tiny"``: hidden 64, 2 layers).
        device: ``"cuda"`` (bfloat16, budgets meaningful) or ``"cpu"`` (float32; a smoke run of the code paths).
        contexts: context lengths in tokens; per-token decode times are compared between the shortest and longest.
        steps: timed decode steps per round; repeats / warmup: rounds of ``measure_interleaved``.
        mode: ``torch.compile`` mode on CUDA (CPU compiles without one).
        max_growth: budget of each cache's per-token growth from the shortest to the longest context, as a multiple
            of the bandwidth floor's growth over the same contexts.
        min_speedup_compiled: budget of static + compile (CUDA graphs) over DynamicCache eager, per token.
        max_floor_ratio: budget of the compiled decode's ms/token over its bandwidth floor (``floor_bytes_per_token``
            over the datasheet bandwidth, ``timing.device_bandwidth``); the eager targets' ratios are reported (at
            batch 1 an eager step is bound by its kernel launches, not by the memory).
        memory_tolerance: allowed relative gap between counted bytes, allocator growth and the formula.
        backend: ``torch.compile`` backend (``"eager"`` exercises dynamo's guards without inductor: fast smoke runs).
        emit: ``emit(report)`` after each section, or None.

    Returns:
        A JSON-serialisable dict: ``ms_per_token`` (milliseconds per decoded token per target), ``floor`` (bandwidth,
        bytes and ms per token at each context), ``floor_ratio`` (measured / floor per cached target),
        ``budgets`` (``{"value", "budget", "ok"}`` each; ``{"value"}`` alone where only reported), ``compile``,
        ``memory`` (bytes), ``sections`` (the sections done), ``ok``, ``seconds``, environment keys.

    Raises:
        RuntimeError: ``device`` is CUDA but CUDA is unavailable (``main`` turns that into a skip).
    """
    import torch
    from torch._dynamo.utils import counters
    from transformers import DynamicCache, StaticCache

    from kvconform.timing import decode_floor_s, device_bandwidth, measure_interleaved

    on_cuda = str(device).startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        raise RuntimeError("requires CUDA (torch.cuda.is_available() is False)")
    emit = emit or (lambda report: None)
    dtype = torch.bfloat16 if on_cuda else torch.float32
    start = time.time()
    model = build_model(size, device, dtype)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    contexts = sorted(contexts)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, cfg.vocab_size, (1, contexts[-1] + steps), generator=gen).to(device)
    subjects = {
        "DynamicCache": lambda n: DynamicCache(config=cfg),
        # one max_cache_len for every context, as a static cache is used: one compiled graph serves them all
        "StaticCache": lambda n: StaticCache(config=cfg, max_cache_len=contexts[-1] + steps),
    }
    mode = mode if on_cuda else None
    cudagraphs = mode in ("reduce-overhead", "max-autotune")
    import transformers

    from kvconform.compat import cache_kwarg

    gpu = torch.cuda.get_device_name(device) if on_cuda else None
    bandwidth, source = device_bandwidth(gpu)
    copy_bw = measured_bandwidth(device)
    floor = {"bandwidth_bytes_per_s": bandwidth, "bandwidth_source": source, "measured_copy_bytes_per_s": copy_bw,
             "bytes_per_token": {}, "ms_per_token": {}}
    for context in contexts:
        per_token = floor_bytes_per_token(model, context, dtype)
        floor["bytes_per_token"][context] = per_token
        floor["ms_per_token"][context] = float(f"{decode_floor_s(per_token, bandwidth) * 1e3:.6g}")
    report = {"size": size, "parameters": n_params, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "torch": torch.__version__, "transformers": transformers.__version__, "cache_kwarg": cache_kwarg(model),
              "gpu": gpu, "mode": mode, "backend": backend, "contexts": contexts, "steps": steps, "repeats": repeats,
              "floor": floor, "compile": {}, "ms_per_token": {}, "floor_ratio": {}, "budgets": {}, "memory": {},
              "sections": [], "ok": None}
    budgets, ms = report["budgets"], report["ms_per_token"]
    lo, hi = contexts[0], contexts[-1]

    def done(section):
        report["sections"].append(section)
        report["seconds"] = round(time.time() - start, 1)
        report["ok"] = all(b.get("ok", True) for b in budgets.values())
        emit(report)

    # 1. memory: the allocator against the counted bytes and the formula (no compile: seconds)
    text = cfg.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * 1 * text.num_key_value_heads * head_dim * dtype.itemsize
    for name, make in subjects.items():
        delta, peak, counted = _memory(model, make, tokens, hi, steps, device)
        formula = per_token * (hi + steps)  # dynamic: S = hi + steps; static: max_cache_len = hi + steps
        report["memory"][name] = {"allocated_delta": delta, "peak_delta": peak, "counted_bytes": counted,
                                  "formula_bytes": formula, "ratio_counted_formula": round(counted / formula, 4)}
        budgets[f"{name} counted bytes == formula"] = _budget(abs(counted / formula - 1), "<=", memory_tolerance)
        if delta is not None:
            report["memory"][name]["ratio_allocated_formula"] = round(delta / formula, 4)
            budgets[f"{name} allocated delta ~ counted"] = _budget(abs(delta / max(counted, 1) - 1), "<=",
                                                                   memory_tolerance)
    done("memory")

    def timed(targets) -> dict:
        """Time ``targets`` side by side; ``{name: ms/token}`` of these rounds. A target's first measurement goes to
        ``ms_per_token`` / ``floor_ratio``; a later one (DynamicCache again, beside the compiled decode) to
        ``ms_per_token_beside_compiled``."""
        timings = measure_interleaved(targets, repeats=repeats, warmup=warmup, device=device,
                                      threads=None if on_cuda else 1)
        these = {name: round(t.median * 1e3, 4) for name, t in timings.items()}
        for name, value in these.items():
            if name in ms:
                report.setdefault("ms_per_token_beside_compiled", {})[name] = value
                continue
            ms[name] = value
            if not name.startswith("uncached"):
                context = int(name.rpartition("@")[2])
                report["floor_ratio"][name] = round(value / floor["ms_per_token"][context], 2)
        return these

    # 2. eager decode speed: each cache and the uncached forward at each context, in the same rounds
    for context in contexts:
        targets = [_decode_target(f"{name}@{context}", model, make, tokens, context, steps)
                   for name, make in subjects.items()]
        targets.append(_uncached_target(f"uncached@{context}", model, tokens, context, max(1, steps // 8)))
        timed(targets)
    floor_growth = floor["ms_per_token"][hi] / floor["ms_per_token"][lo]
    for name in subjects:
        budgets[f"{name} vs uncached @{hi}"] = {"value": round(ms[f"uncached@{hi}"] / ms[f"{name}@{hi}"], 2)}
        budgets[f"{name} growth {lo}->{hi}"] = _budget(ms[f"{name}@{hi}"] / ms[f"{name}@{lo}"], "<=",
                                                       round(max_growth * floor_growth, 3))
    budgets["uncached growth (for contrast)"] = {"value": round(ms[f"uncached@{hi}"] / ms[f"uncached@{lo}"], 2)}
    done("eager speed")

    # 3. compile: recompiles after warm-up, cudagraph skips, then the compiled decode timed beside DynamicCache
    torch.compiler.reset()
    counters.clear()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, mode=mode, backend=backend)
    compile_start = time.time()
    recompiles, reason = _count_recompiles(model, compiled, subjects["StaticCache"], tokens, contexts[0],
                                           min(steps, 8), cudagraphs)
    report["compile"] = {"seconds_incl_first_decode": round(time.time() - compile_start, 1),
                         "recompiles": recompiles, "first_guard": reason,
                         "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0) or 0)}
    budgets["recompiles after warm-up"] = _budget(recompiles, "<=", 0)
    budgets["cudagraph skips"] = _budget(report["compile"]["cudagraph_skips"], "<=", 0)
    done("compile")
    for context in contexts:
        targets = [_decode_target(f"StaticCache+compile@{context}", model, subjects["StaticCache"], tokens,
                                  context, steps, forward=compiled, cudagraphs=cudagraphs),
                   _decode_target(f"DynamicCache@{context}", model, subjects["DynamicCache"], tokens, context, steps)]
        torch.compiler.set_stance("eager_on_recompile")  # a miss runs eagerly (and shows in the times)
        try:
            these = timed(targets)
        finally:
            torch.compiler.set_stance("default")
        budgets[f"StaticCache+compile vs DynamicCache eager @{context}"] = _budget(  # in the same rounds
            these[f"DynamicCache@{context}"] / these[f"StaticCache+compile@{context}"], ">=", min_speedup_compiled)
        budgets[f"StaticCache+compile / floor @{context}"] = _budget(
            report["floor_ratio"][f"StaticCache+compile@{context}"], "<=", max_floor_ratio)
    budgets[f"StaticCache+compile growth {lo}->{hi}"] = _budget(
        ms[f"StaticCache+compile@{hi}"] / ms[f"StaticCache+compile@{lo}"], "<=", round(max_growth * floor_growth, 3))
    report["compile"]["cudagraph_skips"] = int(counters["inductor"].get("cudagraph_skips", 0) or 0)
    budgets["cudagraph skips"] = _budget(report["compile"]["cudagraph_skips"], "<=", 0)
    done("compiled speed")
    return report


def _budget(value, op, bound) -> dict:
    ok = value >= bound if op == ">=" else value <= bound
    return {"value": round(float(value), 3), "budget": f"{op} {bound}", "ok": bool(ok)}


SMOKE = {"size": "tiny", "device": "cpu", "contexts": "16,32", "steps": 2, "repeats": 3, "warmup": 1,
         "backend": "eager"}
"""``--smoke``: every code path of the benchmark at tiny size on CPU, in seconds (budgets not enforced)."""


def main(argv=None) -> int:
    """Console entry point ``kvconform-gpu-bench``. Returns the exit status: 1 when a budget is violated on CUDA,
    else 0 (also for a CPU or smoke run, whose timings mean nothing, and for the skip without CUDA)."""
    parser = argparse.ArgumentParser(prog="kvconform-gpu-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model on CPU, short contexts, eager compile backend: checks the script runs "
                             "(overrides --size, --device, --contexts, --steps, --repeats, --warmup, --backend)")
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test only)")
    parser.add_argument("--contexts", default="512,2048", help="comma-separated context lengths")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per round")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--mode", default="reduce-overhead", help="torch.compile mode on CUDA")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (eager: no code generation)")
    parser.add_argument("--max-growth", type=float, default=1.5,
                        help="per-token growth from the shortest to the longest context, × the floor's growth")
    parser.add_argument("--min-speedup-compiled", type=float, default=1.5,
                        help="static + compile (CUDA graphs) over DynamicCache eager")
    parser.add_argument("--max-floor-ratio", type=float, default=4.0,
                        help="the compiled decode's ms/token over its bandwidth floor")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    try:
        contexts = tuple(int(c) for c in args.contexts.split(","))
    except ValueError:
        parser.error(f"--contexts {args.contexts!r}: expected comma-separated integers, e.g. 512,2048")
    def emit(report):  # after each section: a run cut at its time limit keeps what it measured
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(json.dumps({**report, "complete": False}, indent=2))

    try:
        report = run_gpu_bench(size=args.size, device=args.device, contexts=contexts, steps=args.steps,
                               repeats=args.repeats, warmup=args.warmup, mode=args.mode, max_growth=args.max_growth,
                               min_speedup_compiled=args.min_speedup_compiled, max_floor_ratio=args.max_floor_ratio,
                               backend=args.backend, emit=emit)
    except RuntimeError as exc:
        if "requires CUDA" in str(exc):
            print(f"SKIP: kvconform-gpu-bench {exc}")
            return 0
        raise
    report["complete"] = True
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    print(text)
    bad = [name for name, b in report["budgets"].items() if not b.get("ok", True)]
    smoke = not str(args.device).startswith("cuda")
    print(("smoke run (no budgets on CPU): " if smoke else "") +
          ("all budgets met" if not bad else "budgets violated: " + "; ".join(bad)))
    return 0 if smoke or not bad else 1


if __name__ == "__main__":
    sys.exit(main())
