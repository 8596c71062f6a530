"""A tiny encoder-decoder written from scratch (no transformers) with its own KV cache, and the adapter that lets
kvconform check it: ``pytest --kvconform --kvconform-model kvconform.examples.tiny_encoder_decoder:TinyEncoderDecoder``.

The model, T5 / whisper in miniature: an encoder (token embedding, one pre-norm block of bidirectional
self-attention and a SiLU MLP, a final norm) and a decoder (token embedding, ``layers`` pre-norm blocks of causal
self-attention with rotary positions, cross-attention over the encoder's states, a SiLU MLP; a final norm and an
untied output head). Weights are seeded (``build(seed=0)`` is the same model on every machine).

The cache, as a from-scratch author keeps one (whisper's ``kv_cache`` dict, mlx-examples' per-layer tuples): a list
with one dict per decoder block holding the self-attention ``"key"`` / ``"value"`` ``[B, heads, T, head_dim]``,
extended by concatenation, and the cross-attention ``"cross_key"`` / ``"cross_value"`` ``[B, heads, S_enc,
head_dim]``, projected from the encoder's states once, at the first forward, and read from the cache after that.
``select`` must index both halves with the rows: a select, repeat or beam reorder that moves the self-attention
keys and leaves the cross-attention ones behind (openai/whisper #1483, fixed in #2197; mlx-examples #1429) gives a
row another row's audio — right at batch 1, wrong at batch > 1.

The decoder is never left-padded (the encoder-decoder cases pad nothing): ``mask`` is accepted and not read.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from kvconform.examples.tiny_decoder import rope


def _attend(q, k, v, causal_from: int | None):
    """Attention of ``q`` ``[B, H, Tq, D]`` over ``k``/``v`` ``[B, H, Tk, D]``; ``causal_from``: the offset of the
    first query (key ``j`` is seen by query ``i`` where ``j <= causal_from + i``), or None (no mask)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal_from is not None:
        q_pos = torch.arange(causal_from, causal_from + q.shape[2], device=q.device)
        allowed = torch.arange(k.shape[2], device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) @ v


class Attention(nn.Module):
    """Multi-head attention projections (``heads`` heads of ``dim // heads``)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def split(self, x):
        """``[B, T, dim]`` → ``[B, heads, T, head_dim]``."""
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def merge(self, x):
        """``[B, heads, T, head_dim]`` → ``[B, T, dim]`` through the output projection."""
        b, _, t, _ = x.shape
        return self.out(x.transpose(1, 2).reshape(b, t, -1))


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: causal self-attention (RoPE), cross-attention, SiLU MLP."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn, self.cross_attn = Attention(dim, heads), Attention(dim, heads)
        self.up, self.down = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)


class TinyEncoderDecoderModel(nn.Module):
    """The model. ``encode(enc_ids [B, S]) -> states [B, S, dim]``; ``forward(ids, states, cache=None, start=0) ->
    logits [B, T, vocab]``: with a cache (module docstring) the new self-attention keys and values are appended to
    it, and the cross-attention keys and values are taken from it once it holds them."""

    def __init__(self, vocab: int = 128, dim: int = 32, layers: int = 2, heads: int = 4, hidden: int = 64):
        super().__init__()
        self.enc_embed = nn.Embedding(vocab, dim)
        self.enc_block = DecoderBlock(dim, heads, hidden)  # its cross-attention unused: the encoder's own block
        self.enc_norm = nn.LayerNorm(dim)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(DecoderBlock(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def encode(self, enc_ids):
        """The encoder's states ``[B, S, dim]`` of token ids ``enc_ids`` ``[B, S]`` (bidirectional, RoPE)."""
        blk = self.enc_block
        x = self.enc_embed(enc_ids)
        pos = torch.arange(enc_ids.shape[1], device=enc_ids.device).expand(enc_ids.shape[0], -1)
        h = blk.norm1(x)
        a = blk.self_attn
        q, k = rope(a.split(a.q(h)), pos), rope(a.split(a.k(h)), pos)
        x = x + a.merge(_attend(q, k, a.split(a.v(h)), None))
        x = x + blk.down(nn.functional.silu(blk.up(blk.norm3(x))))
        return self.enc_norm(x)

    def cross(self, layer: dict | None, blk: DecoderBlock, states):
        """The cross-attention keys / values ``[B, heads, S, head_dim]`` of one block: from the cache once it holds
        them, else projected from the encoder's ``states`` (and kept there)."""
        a = blk.cross_attn
        if layer is not None and "cross_key" in layer:
            return layer["cross_key"], layer["cross_value"]
        k, v = a.split(a.k(states)), a.split(a.v(states))
        if layer is not None:
            layer["cross_key"], layer["cross_value"] = k, v
        return k, v

    def forward(self, ids, states, cache=None, start: int = 0):
        b, t = ids.shape
        x = self.embed(ids)
        pos = torch.arange(start, start + t, device=ids.device).expand(b, t)
        for i, module in enumerate(self.blocks):
            blk = cast(DecoderBlock, module)
            layer = None if cache is None else cache[i]
            a = blk.self_attn
            h = blk.norm1(x)
            q, k, v = rope(a.split(a.q(h)), pos), rope(a.split(a.k(h)), pos), a.split(a.v(h))
            if layer is not None:
                if "key" in layer:
                    k, v = torch.cat([layer["key"], k], dim=2), torch.cat([layer["value"], v], dim=2)
                layer["key"], layer["value"] = k, v
            x = x + a.merge(_attend(q, k, v, start))
            c = blk.cross_attn
            ck, cv = self.cross(layer, blk, states)
            x = x + c.merge(_attend(c.split(c.q(blk.norm2(x))), ck, cv, None))
            x = x + blk.down(nn.functional.silu(blk.up(blk.norm3(x))))
        return self.head(self.norm(x))


class TinyEncoderDecoder:
    """The kvconform adapter of ``TinyEncoderDecoderModel`` (``kvconform.scratch`` documents the protocol): an
    encoder-decoder (``is_encoder_decoder = True``), so it defines ``encode`` and its forwards take ``encoder=``."""

    name = "tiny_encoder_decoder"
    vocab_size = 128
    is_encoder_decoder = True
    decoder_start_token_id = 0
    caches: dict = {"TinyCrossCache": {}}

    def build(self, dtype, device, seed: int = 0):
        """The model with seeded weights in ``dtype`` on ``device``."""
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        model = TinyEncoderDecoderModel(vocab=self.vocab_size)
        torch.random.set_rng_state(gen_state)
        return model.to(device=device, dtype=dtype).eval()

    def new_cache(self, model, batch_size: int, max_len: int):
        """An empty cache: one empty dict per decoder block."""
        return [{} for _ in model.blocks]

    def encode(self, model, encoder_ids):
        """The encoder's states ``[B, S_enc, dim]`` of ``encoder_ids`` ``[B, S_enc]`` (int64)."""
        return model.encode(encoder_ids)

    def forward(self, model, ids, cache, start: int, mask=None, encoder=None):
        """Cached forward of the decoder tokens ``ids`` ``[B, T]`` at offsets ``start ..`` given the encoder's
        states ``encoder`` (read at the first forward only: the cache keeps the cross-attention K/V)."""
        return model(ids, encoder, cache, start), cache

    def forward_uncached(self, model, ids, mask=None, encoder=None):
        """The whole decoder sequence ``ids`` ``[B, T]`` without a cache: logits ``[B, T, V]``."""
        return model(ids, encoder, None, 0)

    # optional capabilities
    def crop(self, cache, n: int):
        """Forget the last ``n`` decoder tokens (the cross-attention half stays: the encoder input is the same)."""
        for layer in cache:
            if "key" in layer:
                keep = max(layer["key"].shape[2] - n, 0)
                layer["key"], layer["value"] = layer["key"][:, :, :keep], layer["value"][:, :, :keep]
        return cache

    def select(self, cache, rows):
        """Keep the batch rows ``rows`` (int64), in that order, in both halves: self- and cross-attention."""
        for layer in cache:
            for name in ("key", "value", "cross_key", "cross_value"):
                if name in layer:
                    layer[name] = layer[name][rows]
        return cache

    def seq_length(self, cache) -> int:
        """The decoder tokens per row the cache holds (0 before the first forward)."""
        return int(cache[0]["key"].shape[2]) if cache and "key" in cache[0] else 0
