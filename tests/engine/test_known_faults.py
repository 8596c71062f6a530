"""The known-faults list is held to the same standard as the case files: every entry has an id, every key and name
is checked at load (a bad file is a usage error, exit 4), and a run lists entries that matched nothing (stale) and
xfailed items that passed (XPASS)."""

import textwrap

import pytest
import torch  # noqa: F401 - before pytester snapshots sys.modules (see test_plugin.py)

from kvconform import known_faults
from kvconform.known_faults import KnownFaultsError


def _write(tmp_path, body, name="faults.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _load(path):
    from kvconform import zoo
    from kvconform.checks import FAMILIES, load_checks

    return known_faults.load_known_faults(path, checks=set(load_checks()), families=set(FAMILIES),
                                          models=set(zoo.ZOO_NAMES))


GOOD = """
    [[fault]]
    id = "ok_1"
    transformers = ">=5.5,<5.19"
    subject = "QuantizedCache_*"
    model = ["llama", "mis*"]
    check = "check_reorder_*"
    family = "batch"
    case = "flush*"
    reason = "a reason"
"""

BAD = {
    "bad_evidence": ('evidence = "only (defined"', "key 'evidence': not a regular expression"),
    # a typo that used to widen the entry to every check
    "unknown_key": ('checks = "check_prefill_then_decode"', "fault 'e1': key 'checks': unknown key; allowed keys: id"),
    "bad_specifier": ('transformers = "5.5+"', "fault 'e1': key 'transformers': not a PEP 440 version specifier"),
    "unknown_check": ('check = "check_prefil_then_decode"',
                      "fault 'e1': key 'check': 'check_prefil_then_decode' matches no registered check"),
    "unknown_family": ('family = "crops"', "fault 'e1': key 'family': 'crops' matches no check family"),
    "unknown_model": ('model = ["llama", "lama"]', "fault 'e1': key 'model': 'lama' matches no model"),
    "pattern_type": ("case = 3", "fault 'e1': key 'case': expected a non-empty pattern or list of patterns"),
    "envelope_type": ('envelope = { max_abs = -1 }', "fault 'e1': key 'envelope': expected a table of metric"),
    "envelope_regex": ('envelope = { raised = "(Index" }', "fault 'e1': key 'envelope': raised: not a regular"),
    "inherits_form": ('inherits = "crop"', "fault 'e1': key 'inherits': 'crop': expected 'Class.method'"),
    "inherits_alone": ('inherits = "DynamicLayer.crop"', "fault 'e1': key 'inherits': needs an 'envelope'"),
}


def _entry(extra):
    lines = ['id = "e1"', 'transformers = ">=5.5"', 'reason = "r"']
    key = extra.split("=")[0].strip()
    lines = [line for line in lines if not line.startswith(key + " ")]
    return "[[fault]]\n" + "\n".join([*lines, extra]) + "\n"


def test_a_valid_entry_loads_with_its_id_and_patterns(tmp_path):
    (fault,) = _load(_write(tmp_path, GOOD))
    assert fault.id == "ok_1" and fault.model == ("llama", "mis*") and fault.family == ("batch",)
    from packaging.version import Version

    fields = dict(subject="QuantizedCache_quanto4", model="mistral", check="check_reorder_after_flush",
                  family="batch", case="flush_then_reorder")
    assert fault.matches(Version("5.16.1"), **fields)
    assert not fault.matches(Version("5.19.0"), **fields)
    assert not fault.matches(Version("5.16.1"), **{**fields, "family": "crop"})


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_entry_names_file_entry_and_key(tmp_path, name):
    extra, message = BAD[name]
    path = _write(tmp_path, _entry(extra))
    with pytest.raises(KnownFaultsError) as err:
        _load(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


@pytest.mark.parametrize("body, message", [
    ('[[fault]]\ntransformers = ">=5.5"\nreason = "r"\n', "fault #0: key 'id': missing (required)"),
    ('[[fault]]\nid = "has space"\ntransformers = ">=5.5"\nreason = "r"\n',
     "key 'id': ids may contain only letters, digits, '_' and '-'"),
    ('[[fault]]\nid = "a"\ntransformers = ">=5.5"\nreason = "r"\n[[fault]]\nid = "a"\ntransformers = ">=5.5"\n'
     'reason = "r"\n', "fault 'a': key 'id': duplicate id"),
    ('[[fault]]\nid = "a"\nreason = "r"\n', "fault 'a': key 'transformers': missing (required)"),
    ('[[faults]]\nid = "a"\n', "unknown top-level key(s) ['faults']"),
])
def test_missing_bad_or_duplicate_ids_and_tables_are_rejected(tmp_path, body, message):
    with pytest.raises(KnownFaultsError) as err:
        _load(_write(tmp_path, body))
    assert message in str(err.value)


def test_an_id_defined_in_the_bundled_file_and_an_extra_file_is_rejected(tmp_path):
    bundled = known_faults.load_known_faults()
    path = _write(tmp_path, f'[[fault]]\nid = "{bundled[0].id}"\ntransformers = ">=5.5"\nreason = "r"\n')
    with pytest.raises(KnownFaultsError, match=f"fault '{bundled[0].id}': key 'id': duplicate, already defined in"):
        known_faults.load_all([path])


def test_bundled_file_is_valid_and_no_entry_is_stale_on_the_installed_transformers():
    """Every bundled entry passes the strict loader (build_session validates names), and each entry that applies to
    the installed transformers matches at least one item of the default + full plan over the zoo."""
    from kvconform.session import build_session

    session = build_session()
    assert session.faults and all(f.id for f in session.faults)
    assert len({f.id for f in session.faults}) == len(session.faults)
    assert [f.id for f in session.stale_faults()] == []


def test_the_fault_index_answers_as_the_linear_search_for_every_planned_item():
    """``KVSession.fault_entry`` looks entries up through ``known_faults.FaultIndex`` (set look-ups per field); it
    must give the first matching entry in file order, as ``known_faults.find`` does, for every item of the full plan
    (and for other subjects on the same model/check/case)."""
    from kvconform import known_faults
    from kvconform.compat import transformers_version
    from kvconform.session import build_session

    session = build_session(full=True)
    version = transformers_version()
    found = 0
    for item in session.items():
        for subject in (item.subject.name, "ReferenceCache", "SomeoneElsesCache"):
            expected = known_faults.find(session.faults, version, subject, item.model.name, item.check.name,
                                         item.case.id, item.check.family)
            assert session.fault_entry(subject, item.model.name, item.check.name, item.check.family,
                                       item.case.id) is expected, item.id
            found += expected is not None
    assert found  # the comparison covered items that do have an entry


def test_bad_known_faults_file_is_a_usage_error(run_kvconform, pytester):
    pytester.makefile(".toml", mine=_entry(BAD["unknown_key"][0]))
    result = run_kvconform("--kvconform-model", "llama", "--kvconform-known-faults", "mine.toml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "mine.toml: fault 'e1': key 'checks': unknown key" in result.stderr.str()


def test_run_lists_stale_entries_and_xpassed_items_by_id(run_kvconform, pytester):
    pytester.makefile(".toml", mine=textwrap.dedent("""
        [[fault]]
        id = "pretend-fault"
        transformers = ">=5"
        subject = "DynamicCache"
        model = "llama"
        check = "check_prefill_then_decode"
        case = "decode_explicit_positions"
        reason = "an entry for an item that conforms"

        [[fault]]
        id = "typo-in-case"
        transformers = ">=5"
        model = "llama"
        case = "decode_explicit_position"
        reason = "a case id that does not exist"

        [[fault]]
        id = "other-model"
        transformers = ">=5"
        model = "mamba"
        case = "no_such_case"
        reason = "about a model this run does not select: not judged"

        [[fault]]
        id = "other-version"
        transformers = "<5"
        model = "llama"
        case = "no_such_case"
        reason = "about a transformers version not installed: not judged"
    """))
    result = run_kvconform("--kvconform-model", "llama", "--kvconform-known-faults", "mine.toml",
                           "-k", "DynamicCache and not offloaded and decode_explicit")
    result.assert_outcomes(xpassed=1)
    out = result.stdout.str()
    assert "kvconform known faults" in out
    assert "stale: 'typo-in-case' (transformers >=5; mine.toml) matched no item of this run's plan" in out
    assert ("XPASS: 'pretend-fault': 1 item(s) expected to fail passed, e.g. "
            "test_conformance.py::test_conformance[DynamicCache-llama-prefill_then_decode-decode_explicit_positions]"
            in out)
    assert "other-model" not in out and "other-version" not in out
    stale_lines = [line for line in out.splitlines() if line.startswith("stale: ")]
    assert len(stale_lines) == 1  # the bundled entries all match items of the plan


def test_an_entry_with_evidence_excuses_every_subject_only_where_the_failure_shows_it(run_kvconform, pytester):
    """The EncoderDecoderCache entry names every subject with evidence: ReferenceCache under another name gets the
    same two xfails as ReferenceCache (no false alarm on t5), and DynamicCache (whose crop works) passes instead of
    XPASS."""
    pytest.importorskip("packaging")
    pytester.makepyfile(caches="""
        from kvconform import ReferenceCache

        class MyRef(ReferenceCache):
            pass
    """)
    result = run_kvconform("--kvconform-cache", "caches.py:MyRef", "--kvconform-model", "t5", "--kvconform-json",
                           "r.json", "-k", "(MyRef or ReferenceCache or DynamicCache) and not offloaded and "
                           "(api_surface or crop_short)")
    assert result.ret == 0, result.stdout.str()
    import json

    outcomes = {(r["subject"], r["case"]): r["outcome"]
                for r in json.loads((pytester.path / "r.json").read_text())["results"]}
    assert outcomes[("MyRef", "api_surface")] == outcomes[("ReferenceCache", "api_surface")] == "xfailed"
    assert outcomes[("MyRef", "crop_short")] == outcomes[("ReferenceCache", "crop_short")] == "xfailed"
    assert outcomes[("DynamicCache", "crop_short")] == "passed"
    assert "XPASS" not in result.stdout.str()


def test_an_envelope_excuses_only_failures_of_the_faults_kind_and_size(tmp_path):
    """What the fault does bounds what it excuses: a Δ up to the measured one, the exception it raises; a failure
    10x worse, or an exception where the fault only gives wrong numbers, is outside."""
    path = _write(tmp_path, _entry('envelope = { max_abs = 5.0, raised = "IndexError", bytes_ratio = 2 }'))
    (fault,) = _load(path)
    assert fault.judged_at_run_time
    assert fault.within({"max_abs": 3.2, "tolerance": 1e-4})
    assert not fault.within({"max_abs": 50.0}) and "max_abs 50 (envelope: ≤ 5)" in fault.outside({"max_abs": 50.0})
    assert fault.within({"raised": "IndexError"}) and not fault.within({"raised": "KeyError"})
    assert fault.within({"layer_bytes": 300, "layer_bound": 200}) and not fault.within({"layer_bytes": 3000,
                                                                                        "layer_bound": 200})
    assert not fault.within({"max_abs": float("nan")})
    assert not fault.within({"speedup": 0.1}), "a failure sharing no metric with the envelope is another fault"


def test_an_inherited_transformers_method_is_found_through_the_subjects_classes(tmp_path):
    """Evidence, not names: a DynamicCache subclass that overrides only __init__ uses DynamicSlidingWindowLayer's
    crop and LinearAttentionLayer's missing batch ops unchanged; a layer that overrides crop does not inherit it."""
    from transformers import DynamicCache, MistralConfig
    from transformers.cache_utils import DynamicSlidingWindowLayer

    class KwargsCache(DynamicCache):
        def __init__(self, bits=4, **kwargs):
            super().__init__(**kwargs)
            self.bits = bits

    class OwnCrop(DynamicSlidingWindowLayer):
        def crop(self, max_length):
            raise ValueError("refused")

    config = MistralConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                           sliding_window=4, vocab_size=32)
    path = _write(tmp_path, _entry('inherits = ["DynamicSlidingWindowLayer.crop", "NoSuchLayer.crop"]\n'
                                   'envelope = { raised = "^RuntimeError$" }'))
    (fault,) = _load(path)
    cache = KwargsCache(config=config)
    assert fault.inherited_by(cache) == "DynamicSlidingWindowLayer.crop"
    own = DynamicCache(config=config)
    own.layers = [OwnCrop(sliding_window=4) for _ in own.layers]
    assert fault.inherited_by(own) is None
    from packaging.version import Version

    found, method = known_faults.find_inherited([fault], Version("5.24.0"), cache, "mistral", "check_crop_contract",
                                                "crop_past_window", "crop", metrics={"raised": "RuntimeError"})
    assert (found, method) == (fault, "DynamicSlidingWindowLayer.crop")
    assert known_faults.find_inherited([fault], Version("5.24.0"), cache, "mistral", "check_crop_contract",
                                       "crop_past_window", "crop", metrics={"max_abs": 9.0}) == (None, None)


def test_a_subjects_own_layer_class_inherits_the_faults_of_the_transformers_layer_it_subclasses():
    """Issue 44: a cache of the subject's own whose layers subclass StaticLayer and override only update() uses
    StaticLayer's crop and reset unchanged: the shipped entries for StaticCache's unclamped crop and its reset to
    another batch name those methods (``inherits``), so the subject gets their xfail by inheritance (any subject
    name); a layer that overrides crop is judged on its own. The capacity fault lives in StaticLayer.update, which
    the subject overrides: inherited only when the raise came from inside StaticLayer.update (through super())."""
    from packaging.version import Version
    from transformers import LlamaConfig
    from transformers.cache_utils import Cache, StaticLayer

    class LoggedStaticLayer(StaticLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            self.writes = getattr(self, "writes", 0) + 1
            return super().update(key_states, value_states, *args, **kwargs)

    class ClampedCropLayer(LoggedStaticLayer):
        def crop(self, max_length):
            raise ValueError("crop refused")

    config = LlamaConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                         vocab_size=32)
    faults = {f.id: f for f in known_faults.load_known_faults(known_faults.FAULTS_FILE)}
    crop, reset, capacity = (faults["static-crop-unclamped"], faults["static-reset-other-batch"],
                             faults["static-capacity-indexerror"])
    mine = Cache(layers=[LoggedStaticLayer(max_cache_len=16) for _ in range(config.num_hidden_layers)])
    assert crop.inherited_by(mine) == "StaticLayer.crop"
    assert reset.inherited_by(mine) == "StaticLayer.reset"
    assert capacity.inherited_by(mine) is None, "update() is the subject's own: its capacity failure is its own"

    states = torch.zeros(1, 1, 17, 8)
    try:  # 17 tokens into 16 slots: the override's super().update raises inside StaticLayer.update
        mine.update(states, states, 0)
    except IndexError as exc:
        through_super = exc
    assert capacity.inherited_by(mine, raised=through_super) == "StaticLayer.update"

    class OwnCapacityLayer(LoggedStaticLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            raise IndexError("full")  # the subject's own raise: transformers' update never ran

    try:
        Cache(layers=[OwnCapacityLayer(max_cache_len=16)]).update(states, states, 0)
    except IndexError as exc:
        own_raise = exc
    assert capacity.inherited_by(Cache(layers=[OwnCapacityLayer(max_cache_len=16)]), raised=own_raise) is None
    version = Version("5.25.0")
    found, method = known_faults.find_inherited(list(faults.values()), version, mine, "llama",
                                                "check_crop_then_continue", "crop_more_than_cached", "crop",
                                                metrics={"reported_length": "-2"})
    assert (found, method) == (crop, "StaticLayer.crop")
    assert known_faults.find_inherited([crop], version, mine, "llama", "check_crop_then_continue",
                                       "crop_more_than_cached", "crop", metrics={"max_abs": 3.0}) == (None, None), \
        "a failure outside the entry's envelope (no negative length) is the subject's own"
    own = Cache(layers=[ClampedCropLayer(max_cache_len=16) for _ in range(config.num_hidden_layers)])
    assert crop.inherited_by(own) is None
    assert known_faults.find_inherited([crop], version, own, "llama", "check_crop_then_continue",
                                       "crop_more_than_cached", "crop",
                                       metrics={"reported_length": "-2"}) == (None, None)
    assert reset.inherited_by(own) == "StaticLayer.reset"
