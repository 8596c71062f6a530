"""Vision-language models: the zoo's VLMs are built offline, their prompts carry an image prefix that reaches the
model (cached path and float64 oracle alike), transformers' own caches are right behind it (checked by hand on the
raw model, with explicit pixels), the faults only a VLM exposes are caught with their causes, and
``transformers:PATTERN`` covers the image-text-to-text architectures. Direct API calls only (no pytester run): the
VLM items themselves run under ``--kvconform-full`` or ``--kvconform-model <vlm>``."""

from __future__ import annotations

import copy

import pytest
import torch

from kvconform import vision, zoo

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def vlms():
    return {name: zoo.build_zoo_model(name) for name in zoo.VLM_NAMES}


def _prompt(zm, batch=2, n=18, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return vision.with_image(zm.image, torch.randint(3, zm.vocab_size, (batch, n), generator=gen))


def _pixels(zm, ids, dtype):
    return vision.image_inputs(zm.image, ids, dtype, "cpu")


def test_every_vlm_builds_offline_with_its_image_prefix(vlms):
    for name, zm in vlms.items():
        assert zm.image is not None and zm.image.tokens == zoo.IMAGE_TOKENS, name
        assert zm.vocab_size == zoo.VOCAB_SIZE < zm.image.image_token_id + 1, name  # image ids never drawn
        ids = _prompt(zm)
        assert (ids[:, 1:1 + zm.image.tokens] == zm.image.image_token_id).all(), ids
        assert not (ids[:, 1 + zm.image.tokens:] == zm.image.image_token_id).any(), ids
        # the hook gives every forward the pixels of its keys, and the pixels reach the logits after the image
        other = ids.clone()
        other[:, 0] = (other[:, 0] - 3 + 1) % (zm.vocab_size - 3) + 3
        with torch.no_grad():
            hooked = zm.model(input_ids=ids, use_cache=False).logits
            explicit = zm.model(input_ids=ids, use_cache=False, **_pixels(zm, ids, zm.dtype)).logits
            other_pixels = zm.model(input_ids=ids, use_cache=False, **_pixels(zm, other, zm.dtype)).logits
        assert torch.equal(hooked, explicit), name
        assert float((hooked - other_pixels)[:, 1 + zm.image.tokens:].abs().max()) > 0.1, name


def test_image_prefix_placement_rules():
    spec = vision.ImagePrefix(image_token_id=128, tokens=4, pixel_shape=(3, 8, 8), layout="images",
                              token_type_ids=False, text_vocab=128, vocab=132)
    tokens = torch.arange(3, 3 + 2 * 8).view(2, 8)
    placed = vision.with_image(spec, tokens, pads=[0, 2])
    assert placed[0, 1:5].eq(128).all() and placed[1, 3:7].eq(128).all() and placed[1, :3].tolist() == [11, 12, 13]
    assert torch.equal(vision.with_image(spec, tokens[:, :5]), tokens[:, :5])  # no room for key + block + text
    assert vision.blocks(spec, placed) == [[3], [13]]
    with pytest.raises(vision.PartialImage, match="cut inside its image block"):
        vision.blocks(spec, placed[:, :4])
    # the fuzzer's crops keep whole images: lengths inside either row's block move past it
    assert [vision.uncut_length(spec, placed, k) for k in range(9)] == [0, 1, 7, 7, 7, 7, 7, 7, 8]


@pytest.mark.parametrize("cache_name", ["DynamicCache", "StaticCache"])
def test_transformers_caches_behind_the_image_prefix_by_hand(vlms, cache_name):
    """Prefill (image + text), a chunk across into the text, decode, and a deepcopy continued as a second turn, each
    within 1e-4 of the float64 uncached forward of the same pixels and tokens (pixels passed explicitly)."""
    from transformers import DynamicCache, StaticCache

    for name, zm in vlms.items():
        ids = _prompt(zm)
        oracle = zm.oracle_model()
        with torch.no_grad():
            full = oracle(input_ids=ids, use_cache=False, **_pixels(zm, ids, torch.float64)).logits
            cache = DynamicCache(config=zm.config) if cache_name == "DynamicCache" else \
                StaticCache(config=zm.config, max_cache_len=32)
            outs = [zm.model(input_ids=ids[:, :10], cache=cache, **_pixels(zm, ids[:, :10], zm.dtype)).logits,
                    zm.model(input_ids=ids[:, 10:14], cache=cache).logits]
            fork = copy.deepcopy(cache)
            outs += [zm.model(input_ids=ids[:, t:t + 1], cache=cache).logits for t in range(14, 18)]
            turn = zm.model(input_ids=ids[:, 14:18], cache=fork).logits
        assert float((torch.cat(outs, 1).double() - full).abs().max()) < 1e-4, (name, cache_name)
        assert float((turn.double() - full[:, 14:18]).abs().max()) < 1e-4, (name, cache_name)


def test_gemma3_image_block_is_bidirectional_and_static_cache_keeps_it(vlms):
    """The evidence that transformers' own StaticCache keeps gemma3's bidirectional image block (5.24): dropping the
    block (no token_type_ids) moves the logits by far more than the static cache's distance to the uncached
    forward with it."""
    from transformers import StaticCache

    zm = vlms["gemma3_vlm"]
    ids = _prompt(zm, n=12)
    inputs = _pixels(zm, ids, zm.dtype)
    assert inputs["token_type_ids"][:, 1:5].eq(1).all()
    with torch.no_grad():
        bidirectional = zm.model(input_ids=ids, use_cache=False, **inputs).logits
        causal = zm.model(input_ids=ids, use_cache=False, pixel_values=inputs["pixel_values"]).logits
        static = zm.model(input_ids=ids, cache=StaticCache(config=zm.config, max_cache_len=16), **inputs).logits
    assert float((bidirectional - causal).abs().max()) > 0.05
    assert float((static - bidirectional).abs().max()) < 1e-4


def test_vlms_are_full_tier_or_named_and_announced():
    from kvconform.session import build_session

    default = build_session(checks=["check_prefill_then_decode"], case_ids=["decode_explicit_positions"])
    assert not {m.name for m in default.models} & set(zoo.VLM_NAMES)
    assert any("the vision-language models llava, idefics3, gemma3_vlm" in line for line in default.header_lines())
    assert any("the audio encoder-decoder whisper" in line for line in default.header_lines())  # full tier too
    full = build_session(checks=["check_prefill_then_decode"], case_ids=["decode_explicit_positions"], full=True)
    assert set(zoo.VLM_NAMES) <= {m.name for m in full.models}
    named = build_session(models=["llava"], checks=["check_prefix_fork"])
    assert [m.name for m in named.models] == ["llava"] and named.items()  # a VLM stands in for its text kind


def test_vlm_items_pass_on_correct_caches_and_catch_the_vlm_faults():
    """One direct run: ReferenceCache, the image-segment cache (a correct design of its own), DynamicCache and
    StaticCache pass prefill/decode, fork, generate and multi-turn items on llava and gemma3_vlm; each faulty VLM
    cache fails its target item there with its pinned likely cause and passes on the text model llama."""
    import re

    from transformers import DynamicCache, StaticCache

    from kvconform.api import check_cache
    from kvconform.testing.faulty_vision import FAULTY

    good = check_cache(["kvconform.testing.faulty_vision:image_segment_cache", "kvconform.reference:ReferenceCache"],
                       models=["llava"], checks=["check_prefill_then_decode", "check_prefix_fork"],
                       cases=["decode_explicit_positions", "prefix_fork_steps"])
    # StaticCache's generate builds gemma3's masks before the first forward: the image inputs must reach generate()
    builtin = check_cache([DynamicCache, StaticCache], models=["gemma3_vlm"],
                          checks=["check_prefill_then_decode", "check_generate_greedy", "check_multi_turn"],
                          cases=["decode_explicit_positions", "greedy", "multi_turn"])
    assert {r.outcome for r in good + builtin} == {"passed"}, [(r.id, r.message) for r in good + builtin]
    for faulty in FAULTY:
        [caught] = check_cache(faulty.spec, models=[faulty.model], checks=[faulty.check], cases=[faulty.case])
        assert caught.outcome == "failed", (faulty.name, caught.message)
        cause = next(line for line in caught.message.splitlines() if line.strip().startswith("likely cause:"))
        assert re.search(faulty.cause, cause), (faulty.name, cause)
        [text] = check_cache(faulty.spec, models=["llama"], checks=[faulty.check], cases=[faulty.case])
        assert text.outcome == "passed", (faulty.name, text.message)


def test_a_vlm_checkpoint_folder_is_checked_with_images(vlms, tmp_path):
    """A saved VLM checkpoint (llava: image-text-to-text only; gemma3: mapped by the causal-LM mapping too) is
    loaded with its image-text-to-text class and its prompts carry the image: ReferenceCache passes, and the faulty
    VLM caches fail there with their pinned causes, as on the zoo models they were written for."""
    import re

    from kvconform.api import check_cache
    from kvconform.plan import model_info
    from kvconform.testing.faulty_vision import FAULTY

    folders = {}
    for name in ("llava", "gemma3_vlm"):
        folders[name] = str(tmp_path / f"my_{name}")
        vlms[name].model.save_pretrained(folders[name])
        loaded = zoo.load_model(folders[name])
        assert loaded.image is not None, name
        assert (loaded.image.image_token_id, loaded.image.tokens) == (vlms[name].image.image_token_id,
                                                                       vlms[name].image.tokens), name
        assert loaded.image.token_type_ids == vlms[name].image.token_type_ids, name
        assert model_info(folders[name]).name == f"my_{name}"
    good = check_cache("kvconform.reference:ReferenceCache", models=list(folders.values()),
                       checks=["check_prefill_then_decode"], cases=["decode_explicit_positions"])
    assert len(good) == 2 and {r.outcome for r in good} == {"passed"}, [(r.id, r.message) for r in good]
    for faulty in FAULTY:
        if faulty.model not in folders:
            continue
        [caught] = check_cache(faulty.spec, models=[folders[faulty.model]], checks=[faulty.check],
                               cases=[faulty.case])
        assert caught.outcome == "failed", (faulty.name, caught.message)
        cause = next(line for line in caught.message.splitlines() if line.strip().startswith("likely cause:"))
        assert re.search(faulty.cause, cause), (faulty.name, cause)


def test_image_text_to_text_architectures_survey():
    """``transformers:PATTERN`` covers the image-text-to-text mapping: a VLM type builds with its image prefix
    measured, and one whose image input kvconform cannot feed is listed with its reason (not built)."""
    from kvconform import architectures, sweep
    from kvconform.session import CAUSALITY_TOLERANCE, causality_gap

    assert {"llava", "llava_next", "idefics3", "smolvlm"} <= set(architectures.model_types("*"))
    assert architectures.is_vision_type("llava") and not architectures.is_vision_type("gemma3")
    built = sweep.examine("idefics3", causality_gap, CAUSALITY_TOLERANCE)
    assert built["built"] and built["image"].startswith("image prefix: 1 image tokens per 3×"), built
    refused = sweep.examine("qwen2_vl", causality_gap, CAUSALITY_TOLERANCE)
    assert not refused["built"] and "ImageProbeFailed" in refused["reason"], refused


def test_contract_compile_and_coverage_prompts_start_with_the_image(vlms):
    """The evicting-contract, press, compile and coverage families draw their prompts with the image prefix on a VLM
    (so a cache is checked behind the image there too), and later chunks and decode tokens stay text."""
    from kvconform.cases import Case, Op
    from kvconform.checks import CheckContext, compile as compile_family, contract, coverage
    from kvconform.checks._drive import case_generator
    from kvconform.oracle import Oracle
    from kvconform.subjects import builtin_subjects

    zm = vlms["llava"]
    block = slice(1, 1 + zm.image.tokens)
    subjects = {s.name: s for s in builtin_subjects()}
    case = Case(id="unit", check="check_compile_decode", source="test", batch=2, prompt=12, max_new_tokens=2,
                ops=(Op("prefill", 12), Op("decode", 3)))
    ctx = CheckContext(subjects["DynamicCache"], zm, case, Oracle(zm), reference=subjects["ReferenceCache"])
    for name, (enc, tokens) in compile_family._sequences(ctx).items():
        assert enc is None and tokens.shape == (2, 15), name
        assert (tokens[:, block] == zm.image.image_token_id).all() and not (tokens[:, 1 + zm.image.tokens:]
                                                                            == zm.image.image_token_id).any(), name
    gen = case_generator(case, zm.name)
    prompt, chunk = contract.evicting._tokens(ctx, gen, 2, 12, prompt=True), contract.evicting._tokens(ctx, gen, 2, 12)
    assert (prompt[:, block] == zm.image.image_token_id).all() and not (chunk == zm.image.image_token_id).any()
    prompt, seq, _, _ = coverage._generate(ctx)
    assert (prompt[:, block] == zm.image.image_token_id).all() and torch.equal(seq[:, :12], prompt)
    assert not (seq[:, 12:] == zm.image.image_token_id).any()  # generate never emits an image id
