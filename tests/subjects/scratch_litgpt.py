"""A real from-scratch library through the model adapter (issue 32): litgpt's ``GPT`` (Lightning AI; a llama-style
config, 2 layers, GQA, RoPE) with its own ``KVCache`` — static buffers per block, written at ``input_pos``, kept
inside the model by ``set_kv_cache`` (the gpt-fast layout). Needs ``pip install litgpt`` (tests/subjects/test_scratch.py
skips without it)::

    pytest --kvconform --kvconform-model tests/subjects/scratch_litgpt.py:LitGPT

litgpt's forward takes no padding mask (``takes_mask = False``: padded cases skip) and has no rollback: its cache
reads positions up to ``input_pos`` through the causal mask, so ``crop`` has nothing to do.
"""

import torch


class LitGPT:
    """Adapter of ``litgpt.model.GPT`` with its ``KVCache`` (one per block)."""

    name = "litgpt_llama"
    vocab_size = 128
    takes_mask = False
    caches = {"LitGPTKVCache": {}}
    kv_layout = {"layers": 2, "kv_heads": 2, "head_dim": 8}
    # litgpt's RMSNorm computes in float32 whatever the input (x.float(), litgpt/model.py in 0.5.13): kvconform's
    # float64 oracle would be capped at float32 and refuses it (LitGPTRMSNorm below); torch's LayerNorm follows the
    # input's dtype
    norm = "LayerNorm"

    def build(self, dtype, device):
        from litgpt.config import Config
        from litgpt.model import GPT

        config = Config(n_layer=2, n_head=4, n_embd=32, block_size=640, vocab_size=128, padded_vocab_size=128,
                        n_query_groups=2, bias=False, rotary_percentage=1.0, parallel_residual=False,
                        norm_class_name=self.norm, mlp_class_name="LLaMAMLP", intermediate_size=64)
        state = torch.random.get_rng_state()
        torch.manual_seed(0)
        model = GPT(config)
        torch.random.set_rng_state(state)
        return model.to(device=device, dtype=dtype).eval()

    def new_cache(self, model, batch_size, max_len):
        return {"max_len": max_len, "blocks": None}  # allocated by the first forward, at its batch size

    def forward(self, model, ids, cache, start, mask=None):
        if cache["blocks"] is None:
            p = next(model.parameters())
            model.set_kv_cache(ids.shape[0], max_seq_length=cache["max_len"], device=p.device, dtype=p.dtype)
            cache["blocks"] = [block.attn.kv_cache for block in model.transformer.h]
        for block, kv in zip(model.transformer.h, cache["blocks"]):  # the caches live in the model: put ours there
            block.attn.kv_cache = kv
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        try:
            return model(ids, input_pos=pos), cache
        finally:  # and take them off again (docs/from-scratch.md: a cache that lives inside the model)
            for block in model.transformer.h:
                block.attn.kv_cache = None

    def forward_uncached(self, model, ids, mask=None):
        return model(ids)

    def crop(self, cache, n):
        return cache  # positions come from input_pos; the causal mask hides what lies past them

    def select(self, cache, rows):
        for kv in cache["blocks"] or ():
            kv.k, kv.v = kv.k[rows], kv.v[rows]
        return cache

    def capacity(self, cache):
        return cache["max_len"]


class LitGPTRMSNorm(LitGPT):
    """The same adapter with litgpt's llama ``RMSNorm``: refused before any item runs, naming the module whose float64
    forward computes in float32 (``transformer.h.0.norm_1``)."""

    name = "litgpt_rmsnorm"
    norm = "RMSNorm"
