"""A tiny decoder written from scratch (no transformers) with its own KV cache, and the adapter that lets kvconform
check it: ``pytest --kvconform --kvconform-model kvconform.examples.tiny_decoder:TinyDecoder``.

The model: token embedding, ``layers`` pre-norm blocks of grouped-query attention (``heads`` query heads sharing
``kv_heads`` key/value heads, rotary position embeddings, an optional sliding window of ``window`` tokens) and a
SiLU MLP, then a final norm and an untied output head. Weights are seeded (``build(seed=0)`` is the same model on
every machine).

The cache, as nanoVLM keeps it: a list with one ``{"key": [B, kv_heads, T, head_dim], "value": ...}`` dict per
block (empty dicts before the first forward), which the forward extends by concatenation. The static variant
(``new_cache(static=True)``, listed by ``TinyDecoderTwoCaches``) preallocates ``[B, kv_heads, max_len, head_dim]``
buffers per block and writes at the start offset instead (the gpt-fast layout); its decode step
(``decode_step``, offsets as a tensor, written with ``index_copy_``) is declared compiled (``compiled_decode``), so
the compile family runs on it as on transformers' ``StaticCache``. ``TinyMasklessDecoder`` is the same
model declared without a padding mask (``takes_mask = False``).

The attention mask follows the usual convention: ``mask`` ``[B, start + T]``, 1 for a real token and 0 for a pad
(left padding), over the tokens held and the new ones; positions are then ``cumsum(mask) - 1``.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn


class Block(nn.Module):
    """One pre-norm decoder block: GQA self-attention with RoPE, then a SiLU MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)


def rope(x, positions, base: float = 10000.0):
    """Rotary embedding of ``x`` ``[B, H, T, D]`` at integer ``positions`` ``[B, T]`` (rotate-half form)."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d))
    angles = positions.to(torch.float64)[:, None, :, None] * inv  # [B, 1, T, D/2]
    cos, sin = torch.cos(angles).to(x.dtype), torch.sin(angles).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TinyDecoderModel(nn.Module):
    """The decoder. ``forward(ids, cache=None, start=0, mask=None) -> logits [B, T, vocab]``: with a cache (see the
    module docstring) the new keys and values are appended to it and the queries attend everything it holds."""

    def __init__(self, vocab: int = 128, dim: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 hidden: int = 64, window: int | None = None):
        super().__init__()
        self.window = window
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    # -- the pieces a from-scratch author gets wrong are kept small and separate, so the faulty variants
    #    (kvconform.testing.faulty_scratch) override exactly one of them.
    def positions(self, ids, start: int, mask):
        """Positions ``[B, T]`` of the new tokens: ``start ..`` or, with a padding mask, ``cumsum(mask) - 1``."""
        t = ids.shape[1]
        if mask is None:
            return torch.arange(start, start + t, device=ids.device).expand(ids.shape[0], t)
        return (mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:start + t]

    def attention_bias(self, q_pos, k_pos, key_mask, dtype):
        """Additive bias ``[B, 1, Tq, Tk]``: causal by position, the sliding window, padded keys masked."""
        allowed = k_pos[:, None, :] <= q_pos[:, :, None]
        if self.window is not None:
            allowed = allowed & (q_pos[:, :, None] - k_pos[:, None, :] < self.window)
        allowed = allowed & (k_pos[:, None, :] >= 0)  # a slot at a negative position is empty
        if key_mask is not None:
            allowed = allowed & key_mask[:, None, :].bool()
        bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return bias.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]

    def store(self, layer_cache: dict, k, v, start: int):
        """Append this forward's keys / values ``[B, kv_heads, T, head_dim]`` to one block's cache; return what the
        queries attend (all keys and values held) and their slots (sequence offsets ``[Tk]``)."""
        if "capacity" in layer_cache:  # static: buffers allocated at the first forward, written at the start offset
            b, h, t, d = k.shape
            if "key" not in layer_cache:
                layer_cache["key"] = k.new_zeros(b, h, layer_cache["capacity"], d)
                layer_cache["value"] = v.new_zeros(b, h, layer_cache["capacity"], d)
            layer_cache["key"][:, :, start:start + t] = k
            layer_cache["value"][:, :, start:start + t] = v
            n = start + t
            return layer_cache["key"][:, :, :n], layer_cache["value"][:, :, :n], torch.arange(n, device=k.device)
        if "key" in layer_cache:
            k = torch.cat([layer_cache["key"], k], dim=2)
            v = torch.cat([layer_cache["value"], v], dim=2)
        else:  # copies: ``v`` is a view of the fused key/value projection, which would be kept whole
            k, v = k.clone(), v.clone()
        layer_cache["key"], layer_cache["value"] = k, v
        return k, v, torch.arange(k.shape[2], device=k.device)

    def forward(self, ids, cache=None, start: int = 0, mask=None):
        b, t = ids.shape
        x = self.embed(ids)
        q_pos = self.positions(ids, start, mask)
        for i, module in enumerate(self.blocks):
            blk = cast(Block, module)
            h = blk.norm1(x)
            q = blk.q(h).view(b, t, blk.heads, blk.head_dim).transpose(1, 2)
            k, v = blk.kv(h).view(b, t, 2, blk.kv_heads, blk.head_dim).permute(2, 0, 3, 1, 4)
            q, k = rope(q, q_pos), rope(k, q_pos)
            if cache is None:
                slots = torch.arange(start, start + t, device=ids.device)
            else:
                k, v, slots = self.store(cache[i], k, v, start)
            x = x + blk.out(self.attend(q, k, v, slots, start, mask).transpose(1, 2).reshape(b, t, -1))
            x = x + blk.down(nn.functional.silu(blk.up(blk.norm2(x))))
        return self.head(self.norm(x))

    def decode(self, ids, cache, pos):
        """The compiled decode step of the static cache (gpt-fast style): ``ids`` ``[B, T]`` at offsets ``pos ..``
        (``pos`` a 0-dim int64 tensor, so a compiled graph does not specialise on its value), written into each
        block's preallocated buffers in place (``index_copy_``); the queries attend every slot, the ones not
        written yet masked. Every shape is the same at every step: one graph, no recompile. Returns logits
        ``[B, T, vocab]``."""
        b, t = ids.shape
        x = self.embed(ids)
        q_pos = (pos + torch.arange(t, device=ids.device)).expand(b, t)
        for i, module in enumerate(self.blocks):
            blk, layer = cast(Block, module), cache[i]
            h = blk.norm1(x)
            q = blk.q(h).view(b, t, blk.heads, blk.head_dim).transpose(1, 2)
            k, v = blk.kv(h).view(b, t, 2, blk.kv_heads, blk.head_dim).permute(2, 0, 3, 1, 4)
            q, k = rope(q, q_pos), rope(k, q_pos)
            layer["key"].index_copy_(2, q_pos[0], k)
            layer["value"].index_copy_(2, q_pos[0], v)
            slots = torch.arange(layer["key"].shape[2], device=ids.device)
            k_pos = torch.where(slots < pos + t, slots, -1).expand(b, -1)  # -1: a slot not written yet
            rep = blk.heads // blk.kv_heads
            keys, values = layer["key"].repeat_interleave(rep, dim=1), layer["value"].repeat_interleave(rep, dim=1)
            scores = q @ keys.transpose(-1, -2) / math.sqrt(blk.head_dim)
            scores = scores + self.attention_bias(q_pos, k_pos, None, scores.dtype)
            att = torch.softmax(scores, dim=-1) @ values
            x = x + blk.out(att.transpose(1, 2).reshape(b, t, -1))
            x = x + blk.down(nn.functional.silu(blk.up(blk.norm2(x))))
        return self.head(self.norm(x))

    def attend(self, q, k, v, slots, start: int, mask):
        """Scaled dot-product attention of ``q`` ``[B, H, Tq, D]`` over ``k``/``v`` ``[B, Hkv, Tk, D]`` held at
        ``slots`` (their sequence offsets, -1 for an empty slot); the new queries sit at offsets ``start ..``."""
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q_slots = torch.arange(start, start + q.shape[2], device=q.device).expand(q.shape[0], -1)
        k_slots = slots.expand(q.shape[0], -1)
        key_mask = None if mask is None else mask[:, slots.clamp(min=0)]
        # positions (not slots) decide the window; with left padding both differ by each row's pad count
        if mask is not None:
            pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
            q_slots = pos[:, start:start + q.shape[2]]
            k_slots = torch.where(slots >= 0, pos[:, slots.clamp(min=0)], slots)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores + self.attention_bias(q_slots, k_slots, key_mask, scores.dtype)
        return torch.softmax(scores, dim=-1) @ v


class TinyDecoder:
    """The kvconform adapter of ``TinyDecoderModel`` (``kvconform.scratch`` documents the protocol): model and
    subject at once. ``caches`` lists the caches of this one model that kvconform checks (subject name → keyword
    arguments of ``new_cache``)."""

    name = "tiny_decoder"
    vocab_size = 128
    window: int | None = None
    caches: dict = {"TinyDictCache": {}}
    kv_layout = {"layers": 2, "kv_heads": 2, "head_dim": 8}  # keys and values held per token: the memory formula

    def build(self, dtype, device, seed: int = 0):
        """The model with seeded weights in ``dtype`` on ``device``."""
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        model = TinyDecoderModel(vocab=self.vocab_size, window=self.window)
        torch.random.set_rng_state(gen_state)
        return model.to(device=device, dtype=dtype).eval()

    def new_cache(self, model, batch_size: int, max_len: int, static: bool = False):
        """An empty cache: one empty dict per block, or (``static``) per block the capacity of the zero buffers
        ``[B, kv_heads, max_len, head_dim]`` its first forward allocates (at that forward's batch size: the same
        cache may be reset for another batch)."""
        return [{"capacity": max_len} if static else {} for _ in model.blocks]

    def forward(self, model, ids, cache, start: int, mask=None):
        """Cached forward of the new tokens ``ids`` ``[B, T]`` at offsets ``start ..``: ``(logits [B, T, V],
        cache)``."""
        return model(ids, cache, start, mask), cache

    def forward_uncached(self, model, ids, mask=None):
        """The whole sequence ``ids`` ``[B, T]`` without a cache: logits ``[B, T, V]``."""
        return model(ids, None, 0, mask)

    # optional capabilities
    def crop(self, cache, n: int):
        """Forget the last ``n`` tokens (rollback). A static cache has nothing to do: it reads ``[:start]``."""
        for layer in cache:
            if "key" in layer and "capacity" not in layer:
                keep = max(layer["key"].shape[2] - n, 0)
                layer["key"], layer["value"] = layer["key"][:, :, :keep], layer["value"][:, :, :keep]
        return cache

    def select(self, cache, rows):
        """Keep the batch rows ``rows`` (an int64 index tensor), in that order (beam reorder, select, repeat)."""
        for layer in cache:
            if "key" in layer:
                layer["key"], layer["value"] = layer["key"][rows], layer["value"][rows]
        return cache

    def decode_step(self, model, ids, cache, pos):
        """The decode step kvconform compiles for a static cache (``compiled_decode``): ``ids`` ``[B, T]`` at
        offsets ``pos ..`` (``pos`` a 0-dim int64 tensor) → ``(logits [B, T, V], cache)``. The buffers exist: a
        prefill (the eager ``forward``) allocated them."""
        return model.decode(ids, cache, pos), cache

    def poison(self, cache, start: int, value: float) -> int:
        """Fill every slot the cache holds no token in (a static buffer's tail past the ``start`` tokens it holds)
        with ``value``; returns how many token slots (rows × blocks) it filled. Only kvconform's poisoned-capacity
        cases call it: a promise that those slots are never read (a growing dict cache has none: 0)."""
        filled = 0
        for layer in cache:
            if "capacity" in layer and "key" in layer:
                layer["key"][:, :, start:] = value
                layer["value"][:, :, start:] = value
                filled += layer["key"].shape[0] * max(layer["key"].shape[2] - start, 0)
        return filled

    def capacity(self, cache) -> int:
        """The most tokens per row the cache holds: a static cache's ``max_len``, else -1 (it grows)."""
        return int(cache[0].get("capacity", -1)) if cache else -1


class TinyDecoderTwoCaches(TinyDecoder):
    """The same decoder with two caches listed, checked side by side: the growing dict cache and the static one
    (preallocated buffers, the gpt-fast layout)."""

    name = "tiny_decoder_two_caches"
    caches = {"TinyGrowingCache": {}, "TinyStaticCache": {"static": True}}
    # the static cache's decode step compiles into one graph: kvconform's compile family runs on it (the growing
    # one concatenates, its shapes change every step: it declares none)
    compiled_decode = {"fullgraph": True, "caches": ["TinyStaticCache"]}


class TinySlidingDecoder(TinyDecoder):
    """The same decoder with a sliding window of 8 tokens on every block (its cache keeps every token; the mask
    applies the window)."""

    name = "tiny_sliding_decoder"
    window = 8
    caches = {"TinySlidingDictCache": {}}


class TinyMasklessDecoder(TinyDecoder):
    """The same decoder as a model whose forward takes no padding mask (most models written from scratch): it
    declares ``takes_mask = False``, so kvconform passes it no mask, skips the left-padded cases and runs their
    unpadded twins instead (the batch ops and the bfloat16 / float16 cases on distinct rows of equal length)."""

    name = "tiny_maskless_decoder"
    takes_mask = False
    caches = {"TinyMasklessCache": {}}

    def seq_length(self, cache) -> int:
        """The tokens per row the cache holds: the length of its first block's keys (0 before the first forward)."""
        return int(cache[0]["key"].shape[2]) if cache and "key" in cache[0] else 0

    def forward(self, model, ids, cache, start: int, mask=None):
        """Cached forward of ``ids`` ``[B, T]`` at offsets ``start ..`` (``mask`` is never given)."""
        return model(ids, cache, start), cache

    def forward_uncached(self, model, ids, mask=None):
        """The whole sequence ``ids`` ``[B, T]`` without a cache: logits ``[B, T, V]``."""
        return model(ids, None, 0)
