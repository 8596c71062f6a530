"""Worked examples of models written from scratch, checked through kvconform's model adapter
(``kvconform.scratch``): ``tiny_decoder`` is a small decoder with its own dict KV cache. The examples import only
torch, so that an author can copy one into their own repository."""
