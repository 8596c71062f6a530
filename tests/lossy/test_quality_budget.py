"""The quality family's budget checks on caches of other designs than transformers' QuantizedCache.

Each check must fail on a faulty cache and pass on a correct one:

* ``check_quality_budget``: a per-token int8 cache passes its budget; the same design at 2 bits, declared with the
  int8 budget ("quantization far worse than declared"), fails it; an evicting sinks + window cache passes its budget,
  and one that keeps the oldest tokens instead of the newest fails it.
* ``check_compression_real``: the int8 cache passes (ratio 0.31); the same cache keeping a float32 copy of what it
  quantized fails, naming the copy; a cache that declares a bytes ratio tighter than it achieves fails; a "lossy"
  cache that never quantizes (exact: its quality passes) fails.
* ``check_memory_bound``: the sinks + window cache passes; one that keeps the evicted tokens in a list fails.

The caches are written here, small and plain (``CacheLayerMixin`` layers in a ``transformers.Cache``), and run
in-process through ``kvconform.check_cache`` on the long cases of ``conformance_cases/quality.toml``.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvconform import Budget, CacheSpec, check_cache

MODELS = ["llama"]
CASES = ["quality_long", "compression_long", "memory_bound_long"]


# ------------------------------------------------------------------------------------------ a per-token int cache
class TokenQuantLayer(CacheLayerMixin):
    """Keys and values quantized on arrival, per (row, head, token): symmetric, ``bits`` bits stored in int8, one
    float32 scale per (row, head, token). Attention reads the dequantized history and the new tokens dequantized too.
    ``keep_float``: FAULT — also keeps a float copy of everything it quantized."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, bits: int = 8, keep_float: bool = False):
        super().__init__()
        self.bits, self.keep_float = bits, keep_float
        self.q_keys = self.q_values = self.k_scale = self.v_scale = None
        self.float_keys = self.float_values = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def _quant(self, x):
        qmax = 2 ** (self.bits - 1) - 1
        scale = (x.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=1e-8).to(torch.float32)
        return torch.round(x / scale).clamp(-qmax, qmax).to(torch.int8), scale

    @staticmethod
    def _cat(old, new):
        return new if old is None else torch.cat([old, new], dim=-2)

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        qk, sk = self._quant(key_states)
        qv, sv = self._quant(value_states)
        self.q_keys, self.k_scale = self._cat(self.q_keys, qk), self._cat(self.k_scale, sk)
        self.q_values, self.v_scale = self._cat(self.q_values, qv), self._cat(self.v_scale, sv)
        if self.keep_float:  # FAULT: "for exactness later", the float history is kept as well
            self.float_keys = self._cat(self.float_keys, key_states.clone())
            self.float_values = self._cat(self.float_values, value_states.clone())
        dtype = key_states.dtype
        return (self.q_keys.to(dtype) * self.k_scale).to(dtype), (self.q_values.to(dtype) * self.v_scale).to(dtype)

    def get_seq_length(self) -> int:
        return 0 if self.q_keys is None else self.q_keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # its name on transformers 5.5

    def reset(self) -> None:
        self.q_keys = self.q_values = self.k_scale = self.v_scale = self.float_keys = self.float_values = None
        self.is_initialized = False


def _layers(config) -> int:
    return config.get_text_config(decoder=True).num_hidden_layers


def _token_quant_cache(bits=8, keep_float=False):
    def build(config):
        return Cache(layers=[TokenQuantLayer(bits, keep_float) for _ in range(_layers(config))])

    return build


INT8_BUDGET = Budget(kl_max=1e-3, top1_min=0.9)  # measured on llama: KL ~2e-5, top-1 ~0.99 (see the test)
INT8 = CacheSpec("Int8TokenCache", _token_quant_cache(8), capabilities=frozenset({"forward"}), kind="lossy",
                 budget=INT8_BUDGET)
INT2_DECLARED_INT8 = CacheSpec("Int2AsInt8Cache", _token_quant_cache(2), capabilities=frozenset({"forward"}),
                               kind="lossy", budget=INT8_BUDGET)
INT8_KEEPS_FLOAT = CacheSpec("Int8KeepsFloatCache", _token_quant_cache(8, keep_float=True),
                             capabilities=frozenset({"forward"}), kind="lossy", budget=INT8_BUDGET)


def _never_quantizes(config):
    """A "3-bit" cache whose exact window (128 tokens, as turboquant's or QuantizedCache's default) never fills in a
    short case, and that never quantizes at all: a DynamicCache."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


NEVER_QUANTIZES = CacheSpec("NeverQuantizesCache", _never_quantizes, capabilities=frozenset({"forward"}), kind="lossy",
                            budget=Budget(kl_max=5e-2, top1_min=0.6))
INT8_OVERCLAIMS = CacheSpec("Int8OverclaimsCache", _token_quant_cache(8), capabilities=frozenset({"forward"}),
                            kind="lossy", budget=Budget(kl_max=1e-3, top1_min=0.9, bytes_ratio_max=0.2))


# ------------------------------------------------------------------------------------------ an evicting cache
class SinkWindowLayer(CacheLayerMixin):
    """Attention sinks + a sliding window (StreamingLLM): keeps the first ``sinks`` and the last ``window`` tokens
    after each update (attention of that forward reads everything held plus the new tokens). The mask is given the
    offset that places the window and the new tokens at their absolute positions.

    ``keep_oldest``: keeps the first ``sinks + window`` tokens instead of the sinks and the newest ones.
    ``leak``: FAULT — the evicted tokens are kept in a list (never read again)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, sinks: int = 4, window: int = 60, keep_oldest: bool = False, leak: bool = False):
        super().__init__()
        self.sinks, self.window, self.keep_oldest, self.leak = sinks, window, keep_oldest, leak
        self.keys = self.values = None
        self.seen = 0
        self.evicted = []

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        keys = key_states if self.keys is None else torch.cat([self.keys, key_states], dim=-2)
        values = value_states if self.values is None else torch.cat([self.values, value_states], dim=-2)
        self.seen += key_states.shape[-2]
        held = self.sinks + self.window
        if keys.shape[-2] <= held:
            self.keys, self.values = keys.clone(), values.clone()
        elif self.keep_oldest:  # FAULT: the newest tokens are the ones dropped
            self.keys, self.values = keys[..., :held, :].clone(), values[..., :held, :].clone()
        else:
            if self.leak:  # FAULT: what is evicted is kept
                self.evicted.append((keys[..., self.sinks:-self.window, :].clone(),
                                     values[..., self.sinks:-self.window, :].clone()))
            pick = lambda t: torch.cat([t[..., :self.sinks, :], t[..., -self.window:, :]], dim=-2)  # noqa: E731
            self.keys, self.values = pick(keys), pick(values)
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = 0 if self.keys is None else self.keys.shape[-2]
        return held + query_length, self.seen - held

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length

    def reset(self) -> None:
        self.keys = self.values = None
        self.seen, self.evicted = 0, []
        self.is_initialized = False


def _sink_window_cache(**kwargs):
    def build(config):
        return Cache(layers=[SinkWindowLayer(**kwargs) for _ in range(_layers(config))])

    return build


# 4 sinks + 220 recent tokens: after 240 tokens, 16 are evicted. Measured on llama (quality_long): KL 7.9e-4, top-1
# 0.99. (A tiny random model attends almost uniformly: its quality tells how much was dropped, not which tokens —
# keeping the oldest instead of the newest costs the same KL there.)
SINK_BUDGET = Budget(kl_max=5e-3, top1_min=0.9, tokens_max=224)
SINK_WINDOW = CacheSpec("SinkWindowCache", _sink_window_cache(sinks=4, window=220),
                        capabilities=frozenset({"forward"}), kind="evicting", budget=SINK_BUDGET)
EVICTS_TOO_MUCH = CacheSpec("EvictsTooMuchCache", _sink_window_cache(sinks=4, window=60),
                            capabilities=frozenset({"forward"}), kind="evicting", budget=SINK_BUDGET)
LEAKS_EVICTED = CacheSpec("LeaksEvictedCache", _sink_window_cache(sinks=4, window=220, leak=True),
                          capabilities=frozenset({"forward"}), kind="evicting", budget=SINK_BUDGET)


def _run(specs, cases=CASES, models=MODELS):
    return {(r.subject, r.check, r.model): r for r in check_cache(specs, models=models, cases=cases)}


@pytest.fixture(scope="module")
def lossy_results():
    return _run([INT8, INT2_DECLARED_INT8, INT8_KEEPS_FLOAT, INT8_OVERCLAIMS, NEVER_QUANTIZES])


@pytest.fixture(scope="module")
def evicting_results():
    return _run([SINK_WINDOW, EVICTS_TOO_MUCH, LEAKS_EVICTED])


def test_int8_token_cache_passes_quality_and_compression(lossy_results):
    q = lossy_results[("Int8TokenCache", "check_quality_budget", "llama")]
    c = lossy_results[("Int8TokenCache", "check_compression_real", "llama")]
    assert q.outcome == "passed" and c.outcome == "passed", (q.message, c.message)
    print("int8 llama:", {k: q.metrics[k] for k in ("kl_mean", "top1", "positions")}, c.metrics["bytes_ratio"])
    assert q.metrics["positions"] == 2 * (8 + 48 + 8) and q.metrics["tokens"] == 240
    assert 0 < q.metrics["kl_mean"] <= INT8_BUDGET.kl_max
    # 1 byte + a float32 scale per 16 elements (llama-tiny's head_dim), over 4 bytes: 0.3125
    assert c.metrics["bytes_ratio"] == pytest.approx(0.3125, abs=1e-3)
    bound = lossy_results[("Int8TokenCache", "check_memory_bound", "llama")]  # lossy: not an evicting check
    assert bound.outcome == "skipped" and bound.message.startswith("applies to evicting subjects only")


def test_quantization_worse_than_declared_fails_quality(lossy_results):
    r = lossy_results[("Int2AsInt8Cache", "check_quality_budget", "llama")]
    assert r.outcome == "failed", r.message
    text = r.message
    assert "check_quality_budget failed: Int2AsInt8Cache on llama (fp32, batch 2), case quality_long" in text
    assert "but should be ≤ 1.00e-03 (Int2AsInt8Cache's budget)" in text
    assert "mean KL per op: decode×8: " in text and "(240 tokens)" in text
    assert "likely cause: the cache loses more than its declared budget allows" in text
    assert r.metrics["kl_mean"] > 10 * INT8_BUDGET.kl_max


def test_float_copy_fails_compression(lossy_results):
    assert lossy_results[("Int8KeepsFloatCache", "check_quality_budget", "llama")].outcome == "passed"
    r = lossy_results[("Int8KeepsFloatCache", "check_compression_real", "llama")]
    assert r.outcome == "failed", r.message
    text = r.message
    assert "held bytes = 322,560 B after 240 tokens, 1.312× the 245,760 B an exact cache must hold" in text
    assert "2 attention layers × 2·B2·H_kv2·D16·4B a token × 240 tokens" in text
    assert "largest tensors held: layers[0].float_keys float32 [2, 2, 240, 16]" in text
    assert ("likely cause: the cache keeps every token at full precision besides its compressed data "
            "(layers[0].float_keys, layers[0].float_values, ...: float32 over all 240 tokens)") in text


def test_a_cache_that_never_quantizes_passes_quality_and_fails_compression(lossy_results):
    quality = lossy_results[("NeverQuantizesCache", "check_quality_budget", "llama")]
    assert quality.outcome == "passed" and quality.metrics["kl_mean"] < 1e-9  # exact
    r = lossy_results[("NeverQuantizesCache", "check_compression_real", "llama")]
    assert r.outcome == "failed", r.message
    assert "1.000× the 245,760 B an exact cache must hold, but should be < 1" in r.message
    assert ("likely cause: nothing is compressed: the cache holds what an exact cache holds (layers[0].keys, "
            "layers[0].values, ...: float32 over all 240 tokens)") in r.message


def test_declared_bytes_ratio_is_held(lossy_results):
    r = lossy_results[("Int8OverclaimsCache", "check_compression_real", "llama")]
    assert r.outcome == "failed", r.message
    assert "0.312× the 245,760 B an exact cache must hold, but should be ≤ 0.200 (bytes_ratio_max)" in r.message
    assert "likely cause: the cache compresses less than it declares" in r.message, r.message


def test_sink_window_cache_passes_quality_and_memory_bound(evicting_results):
    q = evicting_results[("SinkWindowCache", "check_quality_budget", "llama")]
    m = evicting_results[("SinkWindowCache", "check_memory_bound", "llama")]
    assert q.outcome == "passed" and m.outcome == "passed", (q.message, m.message)
    print("sinks+window llama:", {k: q.metrics[k] for k in ("kl_mean", "top1")}, m.metrics)
    assert 0 < q.metrics["kl_mean"]  # evicted tokens are missed: not exact
    # 224 tokens × 2 layers × K+V [B2, H_kv2, D16] fp32; it holds exactly that
    assert m.metrics["bytes_held"] == 224 * 2 * 2 * 2 * 2 * 16 * 4 and m.metrics["tokens_equivalent"] == 224
    compression = evicting_results[("SinkWindowCache", "check_compression_real", "llama")]
    assert compression.outcome == "skipped" and "is evicting: its bytes are bounded by check_memory_bound" in \
        compression.message


def test_evicting_more_than_declared_fails_quality(evicting_results):
    assert evicting_results[("EvictsTooMuchCache", "check_memory_bound", "llama")].outcome == "passed"
    r = evicting_results[("EvictsTooMuchCache", "check_quality_budget", "llama")]
    assert r.outcome == "failed", r.message
    text = r.message
    assert "but should be ≤ 5.00e-03 (EvictsTooMuchCache's budget)" in text
    assert "mean KL per op: decode×8: " in text and "chunk(48): " in text
    assert "likely cause: the tokens the cache keeps (budget.tokens_max = 224) do not carry the context" in text


def test_keeping_evicted_tokens_fails_memory_bound(evicting_results):
    r = evicting_results[("LeaksEvictedCache", "check_memory_bound", "llama")]
    assert evicting_results[("LeaksEvictedCache", "check_quality_budget", "llama")].outcome == "passed"
    assert r.outcome == "failed", r.message
    text = r.message
    assert "held bytes = 245,760 B after 240 tokens, but should be ≤ 229,888 B (budget.tokens_max = 224)" in text
    assert ("bound: 224 tokens × 1,024 B a token over 2 attention layers (2·B2·H_kv2·D16·4B each) + "
            "linear-attention states 0 B + slack 256 B × 2 layers") in text
    assert "the cache holds the equivalent of 240 tokens" in text
    assert "largest tensors held: layers[0].keys float32 [2, 2, 224, 16]" in text
    assert ("likely cause: the cache holds all 240 tokens' worth: nothing is evicted, or what is evicted is still "
            "referenced") in text


def test_generate_items_of_budgeted_subjects_skip_with_what_judges_them():
    from kvconform.cases import load_cases
    from kvconform.checks import load_checks
    from kvconform.session import skip_reason
    from kvconform.session import model_info

    checks, cases = load_checks(), {c.id: c for c in load_cases()}
    greedy, info = cases["greedy"], model_info("llama")
    import dataclasses

    from kvconform.subjects import CAPABILITIES

    every = frozenset(CAPABILITIES)
    lossy = skip_reason(dataclasses.replace(INT8, capabilities=every), info, checks["check_generate_greedy"], greedy)
    assert lossy == ("Int8TokenCache is lossy: its greedy generate() is not compared token for token with the exact "
                     "model (a near-tie would flip a greedy token) but with kvconform's own greedy loop on a fresh "
                     "instance fed the same tokens (check_generate_self_consistent); its cache operations are "
                     "judged by self-consistency (logits, crop, prefix, batch, lifecycle, fuzz) and its outputs by "
                     "the quality family (check_quality_budget against the float64 oracle)")
    # an evicting cache is exact until it holds tokens_max tokens: a 22-token generate item is for it
    assert skip_reason(dataclasses.replace(SINK_WINDOW, capabilities=every), info, checks["check_generate_greedy"],
                       greedy) is None
    wide = CacheSpec("TinyWindowCache", _sink_window_cache(sinks=2, window=6), kind="evicting",
                     budget=Budget(kl_max=1, top1_min=0, tokens_max=8))
    reason = skip_reason(wide, info, checks["check_generate_greedy"], greedy)
    assert reason == ("TinyWindowCache evicts past 8 tokens and case greedy makes it hold up to 22: judged by quality "
                      "and the memory bound, not against the exact oracle")
