"""The image prefix of a vision-language model (VLM): where its image block sits in a prompt and which pixels go with
it, the same for every caller (the runner's prefill, ``generate``, the float64 oracle).

A VLM prompt here is ``[key] [image × K] [text ...]`` per row (after a row's left pads): one image block of ``K``
image-token ids (``ImagePrefix.image_token_id``, ``K = ImagePrefix.tokens``: what the model's vision tower makes of
one image), preceded by one ordinary text token, the **key**. The pixels of the block are a function of the key
(``pixels``: seeded from ``ImagePrefix.seed`` and the key token), so whatever the token sequence went through — a
beam reorder, a select, a repeat, a fork, a padded row compared with the row alone — the pixels follow their row,
and one oracle forward of a sequence is the uncached forward of *the same pixels and tokens* the cache saw.

``attach`` registers a forward pre-hook on the transformers model (kept by ``copy.deepcopy``, so the float64 oracle
copy has it too): a forward whose ``input_ids`` hold image blocks and that is given no ``pixel_values`` gets them
(plus ``token_type_ids`` marking the block where the model needs them for its bidirectional image attention,
gemma3), built from the keys in those ``input_ids``. A forward without image tokens (a decode or chunk into a cache
that already holds the image) gets nothing: the image lives in the cache from then on, which is exactly what is
checked. ``generate`` is served the same way (its first forward sees the whole prompt).

The image-token ids and the other ids the VLM reserves (``ImagePrefix.reserved``) lie above the text vocabulary
the checks draw from (``text_vocab``), so random text never contains them; ``generate`` suppresses them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from kvconform.outcomes import KVConformError

HOOK_ATTRIBUTE = "kvconform_image"
"""The attribute of a transformers model carrying its ``ImagePrefix`` (set by ``attach``)."""


@dataclass(frozen=True)
class ImagePrefix:
    """How one VLM takes its image.

    Attributes:
        image_token_id: the placeholder id the model replaces with image features.
        tokens: ``K``, image tokens per image (features the vision tower + projector make of one image).
        pixel_shape: ``(channels, height, width)`` of one image.
        layout: ``"images"`` — ``pixel_values [n_images, C, H, W]`` (llava, gemma3); ``"rows"`` —
            ``[B, images per row, C, H, W]``, rows without an image get an all-zero image, which the model drops
            (idefics3).
        token_type_ids: the model needs ``token_type_ids`` (1 on image tokens) for its bidirectional image block.
        text_vocab: text tokens are drawn below this id; every id from it up is reserved (image and special ids).
        vocab: the model's vocabulary size (logits width).
        seed: seed of the synthetic pixels (with the key token).
    """

    image_token_id: int
    tokens: int
    pixel_shape: tuple
    layout: str
    token_type_ids: bool
    text_vocab: int
    vocab: int
    seed: int = 0
    image_sizes: bool = False
    """The forward takes ``image_sizes`` ``[n_images, 2]`` (height, width) with the pixels (llava-next)."""

    @property
    def reserved(self) -> list[int]:
        """The ids text never draws and ``generate`` never emits (``text_vocab .. vocab - 1``)."""
        return list(range(self.text_vocab, self.vocab))

    @property
    def span(self) -> int:
        """Tokens of one image prefix: the key and the image block (``1 + K``)."""
        return 1 + self.tokens


def of(model) -> ImagePrefix | None:
    """The ``ImagePrefix`` attached to a transformers model (``attach``), or None for a text-only model."""
    return getattr(model, HOOK_ATTRIBUTE, None)


def pixels(spec: ImagePrefix, key: int):
    """The synthetic image of key token ``key``: float32 ``[C, H, W]`` in ``[-1, 1)`` (a normalised image), seeded
    from ``spec.seed`` and ``key`` (the same key → the same image, in every process)."""
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(f"kvconform-image/{spec.seed}/{int(key)}".encode()))
    return torch.rand(tuple(spec.pixel_shape), generator=gen) * 2 - 1


class PartialImage(ValueError, KVConformError):
    """A sequence holds part of an image block (it was cut inside it): no uncached forward has those inputs."""


def blocks(spec: ImagePrefix, input_ids) -> list[list[int]]:
    """Per row of ``input_ids`` ``[B, T]``: the key token of each complete image block (the token before it; 0 when
    the block starts the row), in order.

    Raises:
        PartialImage: a row holds a run of image tokens that is not a whole number of blocks.
    """
    out = []
    for b, row in enumerate(input_ids.tolist()):
        keys, run, start = [], 0, 0
        for t, tok in enumerate([*row, None]):
            if tok == spec.image_token_id:
                if run == 0:
                    start = t
                run += 1
                continue
            if run:
                if run % spec.tokens:
                    raise PartialImage(f"row {b} holds {run} image tokens at positions {start}..{start + run - 1}, "
                                       f"not a whole image of {spec.tokens}: the sequence was cut inside its image "
                                       f"block, and no uncached forward has part of an image as input")
                keys += [row[start - 1] if start else 0] * (run // spec.tokens)
                run = 0
        out.append(keys)
    return out


def uncut_length(spec: ImagePrefix, input_ids, keep: int) -> int:
    """The smallest length ``≥ keep`` at which no row of ``input_ids`` ``[B, T]`` is cut inside an image block (a
    crop keeping ``keep`` tokens would leave part of an image, which no uncached forward has); ``keep`` itself when
    it cuts none."""
    is_image = (input_ids == spec.image_token_id)
    length = int(input_ids.shape[1])
    while 0 < keep < length and bool((is_image[:, keep - 1] & is_image[:, keep]).any()):
        keep += 1
    return keep


def image_inputs(spec: ImagePrefix, input_ids, dtype, device) -> dict:
    """The keyword arguments that go with ``input_ids`` ``[B, T]``: ``pixel_values`` of its image blocks (in
    ``dtype`` on ``device``) and, where the model needs them, ``token_type_ids`` ``[B, T]`` (1 on image tokens);
    ``{}`` when ``input_ids`` holds no image token.

    Raises:
        PartialImage: a row holds part of an image block.
    """
    import torch

    if not bool((input_ids == spec.image_token_id).any()):  # a decode step or a text chunk: nothing to add
        return {}
    keys = blocks(spec, input_ids.cpu())
    if not any(keys):
        return {}
    if spec.layout == "rows":
        most = max(len(k) for k in keys)
        pix = torch.zeros(len(keys), most, *spec.pixel_shape)
        for b, row in enumerate(keys):
            for i, key in enumerate(row):
                pix[b, i] = pixels(spec, key)
    else:
        pix = torch.stack([pixels(spec, key) for row in keys for key in row])
    out = {"pixel_values": pix.to(device=device, dtype=dtype)}
    if spec.image_sizes:
        n = sum(len(k) for k in keys)
        out["image_sizes"] = torch.tensor([list(spec.pixel_shape[1:])] * n, device=device)
    if spec.token_type_ids:
        out["token_type_ids"] = (input_ids == spec.image_token_id).long().to(device)
    return out


def _pre_hook(module, args, kwargs):
    ids = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    spec = of(module)
    if spec is None or ids is None or kwargs.get("pixel_values") is not None or kwargs.get("mm_encoder_outputs"):
        return None
    param = next(module.parameters())
    extra = image_inputs(spec, ids, param.dtype, ids.device)
    if not extra:
        return None
    if kwargs.get("token_type_ids") is not None:
        extra.pop("token_type_ids", None)
    kwargs = {k: v for k, v in kwargs.items() if k != "mm_encoder_outputs"}  # generate passes an empty one
    return args, {**kwargs, **extra}


def seed_zero_projections(model, seed: int = 0, std: float = 0.1) -> list[str]:
    """Draw seeded ``normal(0, std)`` values into every all-zero weight matrix of ``model``'s multimodal projector
    (the modules whose name holds ``projector``), returning their names. Some VLMs initialise a projection to zeros
    (gemma3's ``mm_input_projection_weight``): every image token would embed to the same vector and the image would
    not reach the logits at all."""
    import torch

    done = []
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "projector" in name and param.dim() >= 2 and not bool(param.any()):
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)
                done.append(name)
    return done


def attach(model, spec: ImagePrefix) -> None:
    """Give the transformers VLM ``model`` its image prefix: ``model.kvconform_image = spec`` and a forward pre-hook
    adding ``image_inputs`` to every forward whose ``input_ids`` hold image blocks (module docstring). Its generation
    config suppresses the reserved ids (``generate`` never emits an image token)."""
    import torch

    setattr(model, HOOK_ATTRIBUTE, spec)
    model.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    gc = getattr(model, "generation_config", None)
    if gc is not None:
        gc.suppress_tokens = spec.reserved
    # One uncached forward of an image prompt now: transformers installs the hooks that capture the vision tower's
    # hidden states on a model's first such forward and keeps them; installed inside a subject's per-call context
    # they would read as hooks the context left behind (subjects.ModelLeftChanged).
    ids = with_image(spec, torch.full((1, spec.span + 1), 3, dtype=torch.long))
    with torch.no_grad():
        model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)


def with_image(spec: ImagePrefix, tokens, pads=None):
    """``tokens`` ``[B, n]`` (a prompt's first tokens, drawn below ``spec.text_vocab``) with an image prefix: in
    each row, after its ``pads[b]`` left pads, the first token stays (the key) and the next ``K`` become the image
    block. Rows too short for the prefix and one more text token keep their text, and then so does every row (a
    batch is all image prompts or none). Returns a new tensor."""
    out = tokens.clone()
    pads = list(pads or [0] * tokens.shape[0])
    if any(tokens.shape[1] - p < spec.span + 1 for p in pads):
        return out
    for b, p in enumerate(pads):
        out[b, p + 1:p + spec.span] = spec.image_token_id
    return out
