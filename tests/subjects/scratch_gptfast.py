"""A from-scratch model of our own, written the way gpt-fast writes one: a static ``KVCache`` module per block
(``[B, kv_heads, max_len, head_dim]`` buffers written at ``input_pos`` with ``index_copy_``), a causal mask indexed
by ``input_pos`` over the whole buffer, and a decode step compiled with ``torch.compile(fullgraph=True)``::

    pytest --kvconform --kvconform-full --kvconform-model tests/subjects/scratch_gptfast.py:GptFast

The cache lives inside the model, as in gpt-fast (``setup_caches`` puts a ``KVCache`` on each attention module):
the adapter's cache object is the list of those ``KVCache`` modules, and its ``forward`` installs them on the model
for each call (``install``), so kvconform measures the buffers the cache object reaches, and a fork or a reset is a
new list, not the model's state. The forward takes no padding mask (``takes_mask = False``).

``GptFastTimedStep`` is the faulty variant: its decode step times itself with ``time.perf_counter()`` — right
eagerly, a graph break under ``fullgraph=True``. (Reading the position back with ``int(pos)`` is no fault on torch
2.13: dynamo traces it as a symbolic int, one graph, no recompile.)

For the memory family (tests/subjects/test_scratch_memory.py): ``GptFastBound`` holds its ``KVCache`` modules beside a
reference to its model (charged the buffers only, not the weights); ``GptFastRoomToGrow`` is faulty, allocating four
times the ``max_len`` it is asked for while its ``capacity`` is ``max_len``.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn


class KVCache(nn.Module):
    """gpt-fast's static cache of one block: ``k_cache`` / ``v_cache`` ``[B, H, max_len, D]``."""

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(batch, heads, max_len, head_dim, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(batch, heads, max_len, head_dim, dtype=dtype, device=device))

    def update(self, input_pos, k, v):
        """Write ``k`` / ``v`` ``[B, H, T, D]`` at ``input_pos`` ``[T]``; return the whole buffers."""
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.k_cache, self.v_cache


def rotate(x, positions):
    """Rotary embedding of ``x`` ``[B, H, T, D]`` at ``positions`` ``[T]``, computed in ``x``'s dtype."""
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=x.device, dtype=x.dtype) / d))
    angles = positions.to(x.dtype)[:, None] * inv
    cos, sin = torch.cos(angles), torch.sin(angles)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x, input_pos, mask):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(x).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, input_pos), rotate(k, input_pos)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return self.wo((torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, -1))


class Transformer(nn.Module):
    """``forward(idx [B, T], input_pos [T])`` → logits ``[B, T, vocab]``: with caches installed, attends every slot
    of their buffers through ``causal[input_pos]``; without, the causal mask over ``T``."""

    def __init__(self, vocab: int = 128, dim: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.attn = nn.ModuleList(Attention(dim, heads, kv_heads) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 64, bias=False), nn.SiLU(), nn.Linear(64, dim, bias=False))
            for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2 * layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def install(self, caches):
        """Put one ``KVCache`` on each attention module (None: uncached), as gpt-fast's ``setup_caches``."""
        for attn, cache in zip(self.attn, caches or [None] * len(self.attn)):
            attn.kv_cache = cache

    def forward(self, idx, input_pos):
        t = idx.shape[1]
        cache = self.attn[0].kv_cache
        keys = cache.k_cache.shape[2] if cache is not None else t
        slots = torch.arange(keys, device=idx.device)
        mask = (slots[None, :] <= input_pos[:, None])[None, None]  # [1, 1, T, keys]
        x = self.tok_embeddings(idx)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            x = x + attn(self.norms[2 * i](x), input_pos, mask)
            x = x + mlp(self.norms[2 * i + 1](x))
        return self.output(self.norm(x))


class GptFast:
    """The adapter: caches are lists of ``KVCache`` modules, installed on the model for each forward."""

    name = "gptfast_tiny"
    vocab_size = 128
    takes_mask = False
    caches = {"GptFastKVCache": {}}
    kv_layout = {"layers": 2, "kv_heads": 2, "head_dim": 8}
    compiled_decode = {"fullgraph": True}

    def build(self, dtype, device, seed: int = 0):
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        model = Transformer()
        torch.random.set_rng_state(state)
        return model.to(device=device, dtype=dtype).eval()

    def new_cache(self, model, batch_size, max_len):
        p = model.output.weight
        return [KVCache(batch_size, a.kv_heads, max_len, a.head_dim, p.dtype, p.device) for a in model.attn]

    def _run(self, model, ids, cache, input_pos):
        model.install(cache)
        try:
            return model(ids, input_pos)
        finally:
            model.install(None)  # the cache is the caller's: the model keeps none between calls

    def forward(self, model, ids, cache, start, mask=None):
        return self._run(model, ids, cache, torch.arange(start, start + ids.shape[1], device=ids.device)), cache

    def decode_step(self, model, ids, cache, pos):
        return self._run(model, ids, cache, pos + torch.arange(ids.shape[1], device=ids.device)), cache

    def forward_uncached(self, model, ids, mask=None):
        return self._run(model, ids, None, torch.arange(ids.shape[1], device=ids.device))

    def crop(self, cache, n):
        return cache  # the mask reads slots up to input_pos: the next write overwrites the dropped ones

    def select(self, cache, rows):
        for c in cache:
            c.k_cache, c.v_cache = c.k_cache[rows], c.v_cache[rows]
        return cache

    def capacity(self, cache):
        return int(cache[0].k_cache.shape[2])


class GptFastTimedStep(GptFast):
    """Faulty: the decode step times itself with ``time.perf_counter()`` (a step timer kept on the adapter): right
    eagerly, a graph break under ``fullgraph=True`` (dynamo cannot trace the builtin)."""

    name = "gptfast_timed_step"
    caches = {"TimedKVCache": {}}
    step_seconds = 0.0

    def decode_step(self, model, ids, cache, pos):
        started = time.perf_counter()
        out = super().decode_step(model, ids, cache, pos)
        self.step_seconds = time.perf_counter() - started
        return out


class BoundKVCaches:
    """A cache object that keeps a reference to the model it was made for (and so to every weight of it) beside its
    ``KVCache`` modules: ``model`` and ``blocks``."""

    def __init__(self, model, blocks):
        self.model, self.blocks = model, blocks


class GptFastBound(GptFast):
    """Correct: the same caches, each held by a ``BoundKVCaches`` that refers to its model (an author keeping the
    model at hand for ``install``). The model's weights are the model's: kvconform charges the cache only its
    ``KVCache`` buffers."""

    name = "gptfast_bound"
    caches = {"BoundKVCache": {}}
    compiled_decode = None

    def new_cache(self, model, batch_size, max_len):
        return BoundKVCaches(model, super().new_cache(model, batch_size, max_len))

    def _run(self, model, ids, cache, input_pos):
        return super()._run(model, ids, None if cache is None else cache.blocks, input_pos)

    def select(self, cache, rows):
        super().select(cache.blocks, rows)
        return cache

    def capacity(self, cache):
        return super().capacity(cache.blocks)


class GptFastRoomToGrow(GptFast):
    """Faulty: ``new_cache`` allocates each ``KVCache`` four times the ``max_len`` it is asked for ("room to grow
    later") while the cache never takes more than ``max_len`` tokens (``capacity``): three quarters of every buffer
    are bytes held for nothing."""

    name = "gptfast_room_to_grow"
    caches = {"RoomToGrowKVCache": {}}
    compiled_decode = None

    def new_cache(self, model, batch_size, max_len):
        blocks = super().new_cache(model, batch_size, 4 * max_len)
        for block in blocks:
            block.max_len = max_len
        return blocks

    def capacity(self, cache):
        return cache[0].max_len
