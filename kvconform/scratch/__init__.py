"""Models written from scratch (no transformers), with their own KV cache: the model adapter behind
``--kvconform-model MODULE:ATTR`` (or ``FILE.py:ATTR``).

An **adapter** is a class (instantiated with no arguments) or an object its author writes in 20–40 lines; it is the
model and its subjects at once. Required (``REQUIRED``):

* ``build(dtype, device)`` → the model, an ``nn.Module`` with seeded weights (float64 must work: the oracle is
  this model's own uncached forward in float64).
* ``new_cache(model, batch_size, max_len, **options)`` → an empty cache (any object: a list of dicts, a class
  of the author's...). ``max_len`` is the most tokens a row holds in the item.
* ``forward(model, ids, cache, start, mask=None)`` → ``(logits, cache)``: the cached forward of the new token ids
  ``ids`` ``[B, T]`` (int64) at sequence offsets ``start .. start+T-1`` (``start``: the tokens the cache holds,
  pads included); ``mask`` ``[B, start+T]`` (1 real token, 0 left pad) or None; logits ``[B, T, V]`` float in the
  model's dtype.
* ``forward_uncached(model, ids, mask=None)`` → logits ``[B, T, V]`` of the whole sequence without a cache.

Optional, each a capability (a check needing one the adapter lacks skips, saying which method would enable it):

* ``crop(cache, n)`` → cache: forget the last ``n`` tokens (rollback, speculative decoding) — capability ``crop``.
* ``select(cache, rows)`` → cache: keep the batch rows ``rows`` (int64 ``[B']``) in that order — one method gives
  beam reorder, select and repeat (``reorder``, ``batch_select``, ``batch_repeat``).
* ``fork(cache)`` → an independent copy (default ``copy.deepcopy``) — prefix forks.
* ``seq_length(cache)`` → the tokens it says it holds (default: kvconform's own count).
* ``reset(cache)`` → the cache emptied for a new sequence, its batch size free (default: ``new_cache`` again).
* ``takes_mask = False``: its forward takes no padding mask: the left-padded cases skip, and their unpadded twins
  (the batch ops and the bfloat16 / float16 cases on distinct rows of equal length; case feature
  ``no_padding_mask``) run instead; the float64 pre-check (``float64_problem``) passes it no mask.
* ``capacity(cache)`` → the most tokens per row it keeps (a ring buffer of its window), or -1 / None: unbounded
  (default).
* ``kv_layout``: ``{"layers", "kv_heads", "head_dim"}`` — the keys and values it must hold per token, for the
  memory family's byte formula (without it the memory items skip, saying so).
* ``caches``: ``{subject name: new_cache keyword arguments}`` — several caches of one model (default one, named
  after the adapter's class with ``Cache`` appended); ``name``: the model's name in ids (default the class name);
  ``vocab_size`` (default 128): tokens are drawn below it; ``window``: a sliding window in tokens, or None;
  ``max_positions``: the most tokens its model takes in one sequence (a learned position table), or None: items
  that would make it see more are skipped with that reason (``plan.position_limit``), never run into its limit.

* ``compiled_decode = {"fullgraph", "step", "caches"}`` and ``decode_step(model, ids, cache, pos)`` (``pos`` a 0-dim
  int64 tensor): a decode step compiled with ``torch.compile`` for those caches — capability ``compile``
  (``compiled_decode``; ``ScratchModule.compiled_forward`` compiles that step only; full tier: the compile
  checks' ``adapter_full_tier``).

An encoder-decoder (``is_encoder_decoder = True``; ``ENCODER_DECODER``, checked by ``encoder_decoder_problem``: a
half-declared one is a usage error) defines ``encode(model, encoder_ids)`` → the encoder's states (``encoder_ids``
``[B, S_enc]`` int64, the case's seeded encoder input) and takes ``encoder=states`` in ``forward`` and
``forward_uncached`` (``ids`` are then the decoder's tokens; ``decoder_start_token_id``, default 0, starts
``generate``). Every forward encodes the rows' encoder ids again (the oracle, the cached run and the reference see
the same input, and it follows the rows through select / repeat / reorder); the adapter's ``select`` must move the
cross-attention half of its cache with the rows itself. Its cache is never wrapped in ``EncoderDecoderCache``.

The oracle's model is ``build(float64, "cpu")`` (``oracle_module``), refused before any item runs where its forward
computes in a narrower dtype inside (``narrow_computation``, in ``float64_problem``).

kvconform wraps the adapter's model in ``ScratchModule`` (an ``nn.Module`` whose forward takes the keyword
arguments kvconform's drivers pass a transformers model) and each cache in ``ScratchCache`` (a
``transformers.Cache`` whose ``crop`` / ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` /
``reset`` / ``deepcopy`` call the adapter), so the op interpreter (``checks/_interpreter.py``) drives it like any
subject; ``ScratchModule.generate`` is kvconform's own greedy decoding loop over the cached forward. What cannot
apply to a model outside transformers is skipped with its reason (``not_applicable``).

The package, one module per job: ``adapter`` (the spec, loading, protocol validation, what the adapter declares),
``module`` (``ScratchModule``, the model at a dtype, the float64 oracle and its pre-check), ``cache``
(``ScratchCache`` and the adapter's caches as subjects), ``applicability`` (what does not apply to such a model, and
why), ``causes`` (a failure said in the adapter's terms). Every public name is importable from ``kvconform.scratch``
itself; ``ScratchModule`` and ``ScratchCache`` are built on first access (no torch or transformers import before).
"""

from __future__ import annotations

from kvconform.scratch.adapter import (  # noqa: F401 - the package's public names
    REQUIRED, EXAMPLES, is_scratch_spec, spec_problem, AdapterError, ModelForwardError, AdapterUsageError,
    load_adapter, is_adapter, register_adapter, adapter_problem, model_name, layer_types, vocab_size, takes_mask,
    capabilities, compiled_decode, is_encoder_decoder, encoder_decoder_problem, ENCODER_DECODER, _NOTES)
from kvconform.scratch.module import (  # noqa: F401 - the package's public names
    ScratchOutput, ScratchConfig, scratch_module_class, scratch_module, build_model, oracle_module, float64_problem,
    narrow_computation)
from kvconform.scratch.cache import (  # noqa: F401 - the package's public names
    scratch_cache_class, adapter_cache_spec_class, allocation_of, subjects)
from kvconform.scratch.applicability import (  # noqa: F401 - the package's public names
    not_applicable, dtype_problem, unpadded_twin)
from kvconform.scratch.causes import (  # noqa: F401 - the package's public names
    likely_cause, adapter_lines)


def __getattr__(name: str):
    """``ScratchModule`` and ``ScratchCache``: the classes, built on first access (``scratch_module_class``,
    ``scratch_cache_class``), so that importing this package imports neither torch nor transformers."""
    if name == "ScratchModule":
        return scratch_module_class()
    if name == "ScratchCache":
        return scratch_cache_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
