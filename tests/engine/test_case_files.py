"""The built-in case files: where they live, one file per check family, and the tier scope (``models_full``)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvconform.cases import CaseFileError, builtin_cases_dir, load_case_file, load_cases
from kvconform.checks import load_checks
from kvconform.checks.memory import MEMORY_OPS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def registry():
    return load_checks()


@pytest.fixture(scope="module")
def builtin(registry):
    return load_cases(known_checks=set(registry))


def test_builtin_cases_come_from_the_checkout_folder():
    # tests run from a source checkout (PYTHONPATH or an editable install): the top-level folder, not a copy
    # installed elsewhere
    assert builtin_cases_dir() == REPO / "conformance_cases"


def test_one_case_file_per_check_family_and_every_case_in_its_family_file(registry, builtin):
    families = {check.family for check in registry.values()}
    files = {p.stem for p in builtin_cases_dir().glob("*.toml")}
    assert files == families, f"case files {sorted(files)} vs check families {sorted(families)}"
    misplaced = [f"{c.id} ({c.check}, family {registry[c.check].family}) is in {Path(c.source).name}"
                 for c in builtin if Path(c.source).name != f"{registry[c.check].family}.toml"]
    assert not misplaced, "cases outside their family's file: " + "; ".join(misplaced)


def test_no_twin_cases(builtin):
    """A case that differs from another only in its model scope, tier or description is a twin: widen the first
    one's scope in the full tier with ``models_full`` instead."""
    scope_fields = {"id", "source", "description", "models", "models_full", "tier"}

    def scenario(case):
        fields = {k: v for k, v in dataclasses.asdict(case).items() if k not in scope_fields}
        return repr(sorted(fields.items()))

    seen = {}
    twins = []
    for case in builtin:
        key = scenario(case)
        if key in seen:
            twins.append((seen[key], case.id))
        seen.setdefault(key, case.id)
    assert not twins, f"twin cases (use models_full): {twins}"


def test_models_full_widens_the_scope_in_the_full_tier_only(builtin):
    by_id = {c.id: c for c in builtin}
    crop_short = by_id["crop_short"]
    assert crop_short.model_scope(full=False) == ("llama", "gemma3", "t5", "mamba", "falcon_h1")
    assert crop_short.model_scope(full=True) == ()  # "all"
    speed = by_id["speed_vs_uncached"]
    assert speed.model_scope(full=False) == ("llama",)
    assert "mistral" in speed.model_scope(full=True) and "gpt2" not in speed.model_scope(full=True)
    assert by_id["crop_zero"].model_scope(full=True) == ("llama", "gemma3")  # no models_full: same in both tiers


def test_session_items_follow_the_tier_scope():
    from kvconform.session import build_session

    def models_of(full):
        session = build_session(models=["llama", "mistral", "mamba2"], case_ids=["crop_short"], full=full)
        return sorted({item.model.name for item in session.items() if item.subject.name == "ReferenceCache"})

    assert models_of(full=False) == ["llama"]
    assert models_of(full=True) == ["llama", "mamba2", "mistral"]


@pytest.mark.parametrize("body, problem", [
    ('models = ["llama"]\nmodels_full = "all"\ntier = "full"', "only for default-tier cases"),
    ('models_full = "all"', "already runs on every model"),
    ('models = ["llama", "t5"]\nmodels_full = ["llama", "mistral"]', "missing ['t5']"),
    ('models = ["llama"]\nmodels_full = "every"', 'expected "all" or a non-empty list'),
    ('models = ["llama"]\nmodels_full = []', 'expected "all" or a non-empty list'),
    ('models = ["llama"]\nmodels_full = 3', "expected list/str"),
])
def test_bad_models_full_names_file_case_and_key(tmp_path, body, problem):
    path = tmp_path / "mine.toml"
    path.write_text(f'[[case]]\nid = "c1"\ncheck = "check_prefill_then_decode"\nops = ["prefill 4"]\n{body}\n')
    with pytest.raises(CaseFileError) as err:
        load_case_file(path)
    assert "mine.toml" in str(err.value) and "case 'c1'" in str(err.value) and "'models_full'" in str(err.value)
    assert problem in str(err.value)


# ---------------------------------------------------------------------------------- cases wrong for their check
# Each: (name, TOML lines of one case "mine" — check included —, the key named, text the usage error contains).
# Every one was a ValueError traceback counted against the cache at run time, or a silent no-op, before.
WRONG_FOR_CHECK = [
    ("ops_ignored", 'check = "check_beam_search"\nops = ["prefill 4", "decode 2"]', "ops",
     "check_beam_search does not read 'ops' (it makes its own calls); got ops = ['prefill 4', 'decode 2']: "
     "remove 'ops'"),
    ("ops_ignored_fuzz", 'check = "check_op_sequences"\nops = ["prefill 4"]', "ops",
     "check_op_sequences does not read 'ops'"),
    ("no_chunk", 'check = "check_chunked_continuation"\nops = ["prefill 12", "decode 2"]', "ops",
     "check_chunked_continuation needs at least one 'chunk N' op"),
    ("no_first_prefill", 'check = "check_prefill_then_decode"\nops = ["decode 2"]', "ops",
     "check_prefill_then_decode needs ops starting with 'prefill N'"),
    ("quality_one_forward", 'check = "check_quality_budget"\nops = ["prefill 12"]\n'
     'params = {kl_max = 0.1, top1_min = 0.5}', "ops", "check_quality_budget needs at least 2 forward(s)"),
    ("lossy_driver_refuses", 'check = "check_quality_budget"\nops = ["prefill 12", "fork", "decode 3"]\n'
     'params = {kl_max = 0.1, top1_min = 0.5}', "ops",
     "check_quality_budget cannot run op 'fork': its driver accepts only 'prefill', 'decode', 'chunk', 'crop', "
     "'reorder'"),
    ("crop_refused_reset", 'check = "check_crop_refused"\nops = ["prefill 6", "reset", "prefill 4", "crop 1"]', "ops",
     "check_crop_refused cannot run op 'reset'"),
    ("memory_fork", 'check = "check_memory_bytes"\nops = ["prefill 6", "fork", "decode 2"]', "ops",
     "check_memory_bytes cannot run op 'fork': its driver accepts only "
     + ", ".join(map(repr, MEMORY_OPS))),  # the op table's order: a new op that the driver accepts is named too
    ("bookkeeping_fork", 'check = "check_length_bookkeeping"\nops = ["prefill 6", "fork", "decode 2"]', "ops",
     "check_length_bookkeeping cannot run op 'fork'"),
    ("crop_refused_no_crop", 'check = "check_crop_refused"\nops = ["prefill 6", "decode 2"]', "ops",
     "check_crop_refused needs at least one 'crop N' op"),
    ("reset_missing", 'check = "check_reset_then_reuse"\nops = ["prefill 6", "decode 2"]', "ops",
     "check_reset_then_reuse needs at least one 'reset' op"),
    ("prefix_generate_shape", 'check = "check_prefix_generate"\nops = ["prefill 6", "decode 2"]', "ops",
     "check_prefix_generate needs ops = ['prefill N']"),
    ("api_contract_shape", 'check = "check_api_contract"\nops = ["prefill 6", "decode 2"]', "ops",
     "check_api_contract needs ops = ['prefill N'] (or no ops)"),
    ("compile_shape", 'check = "check_compile_static_decode"\nops = ["prefill 6", "chunk 2", "decode 8"]', "ops",
     "check_compile_static_decode needs ops = ['prefill N', 'decode N']"),
    ("compile_one_step", 'check = "check_compile_claim"\nops = ["prefill 6", "decode 1"]', "ops",
     "the compile checks need ops = ['prefill P', 'decode N'] with N ≥ 2"),
    ("addresses_one_forward", 'check = "check_static_addresses"\nops = ["prefill 6"]', "ops",
     "check_static_addresses needs at least 2 forward(s)"),
    ("deepcopy_no_ops", 'check = "check_deepcopy_refused"', "ops",
     "check_deepcopy_refused needs ops starting with 'prefill N'"),
    ("offload_no_prefill", 'check = "check_offloaded_matches"\nops = ["decode 8"]', "ops",
     "check_offloaded_matches needs ops starting with 'prefill N'"),
    ("fork_first", 'check = "check_prefix_fork"\nops = ["fork", "prefill 4", "decode 1"]', "ops",
     "check_prefix_fork needs ops 'prefix ops, fork, suffix ops'"),
    ("reorder_batch_1", 'check = "check_reorder_then_decode"\nbatch = 1\nops = ["prefill 6", "reorder", "decode 2"]',
     "batch", "check_reorder_then_decode needs batch ≥ 2 (a non-identity reorder needs two rows); got batch = 1"),
    ("select_batch_1", 'check = "check_select_then_decode"\nbatch = 1\nops = ["prefill 6", "select", "decode 2"]',
     "batch", "check_select_then_decode needs batch ≥ 2"),
    ("capacity_not_exceeded", 'check = "check_capacity"\nops = ["prefill 6", "decode 2"]', "ops",
     "check_capacity needs ops feeding more tokens than params.max_cache_len (12); they feed 8"),
    ("encdec_without_requires", 'check = "check_encoder_decoder_subcaches"\nops = ["prefill 4", "decode 2"]',
     "requires", "check_encoder_decoder_subcaches reads the cross-attention sub-cache: it needs requires = "
     "['encoder_decoder']"),
    ("speed_short_context", 'check = "check_speed_vs_uncached"\nparams = {context = 128, min_speedup = 1.5}',
     "params.context", "check_speed_vs_uncached needs context ≥ 512"),
    ("speed_growth_span", 'check = "check_speed_flat_decode"\nparams = {short = 256, long = 512, max_growth = 2.0}',
     "params.long", "check_speed_flat_decode needs long ≥ 4 × short to see growth; got short = 256, long = 512"),
    ("quality_budget_table", 'check = "check_quality_budget"\nops = ["prefill 12", "decode 4"]\n'
     'params = {kl_max = {"4" = 0.1}, top1_min = 0.5}', "params.kl_max", "expected number ≥ 0, got dict"),
    # silent no-ops
    ("crop_past_held", 'check = "check_prefill_then_decode"\nops = ["prefill 12", "crop 20", "decode 2"]', "ops",
     "op 2 'crop 20' removes 20 tokens from a cache holding 12 (ops ['prefill 12', 'crop 20', 'decode 2']): crop at "
     "most 12 (crop 12 empties the cache); cropping past the start is the edge case of check_crop_contract, "
     "check_crop_then_continue, not of check_prefill_then_decode"),
    ("crop_past_held_after_reset", 'check = "check_crop_then_continue"\n'
     'ops = ["prefill 12", "reset", "prefill 3", "crop 4", "decode 1"]', "ops",
     "op 4 'crop 4' removes 4 tokens from a cache holding 3 (ops ['prefill 12', 'reset', 'prefill 3', 'crop 4', "
     "'decode 1']): crop at most 3 (crop 3 empties the cache); to crop past the start on purpose (the edge case), "
     "set params.crop_beyond_held = true"),
    ("crop_on_empty", 'check = "check_crop_contract"\nops = ["crop 1", "prefill 4"]', "ops",
     "op 1 'crop 1' removes 1 token from a cache holding 0 (ops ['crop 1', 'prefill 4']): prefill before the crop"),
    ("padding_short", 'check = "check_repeat_then_decode"\nbatch = 3\nops = ["prefill 8", "repeat 2", "decode 1"]\n'
     'params = {padding = [0, 3]}', "params.padding",
     "2 pad count(s) [0, 3] for batch = 3: give one count per row"),
    ("padding_long", 'check = "check_beam_search"\nparams = {padding = [0, 3, 1]}', "params.padding",
     "3 pad count(s) [0, 3, 1] for batch = 2"),
    ("padding_whole_row", 'check = "check_reorder_then_decode"\nops = ["prefill 3", "reorder", "decode 1"]\n'
     'params = {padding = [0, 3]}', "params.padding",
     "row 1 is padded by 3 of its 3 prompt tokens ('prefill 3'): every row needs a real token; pad at most 2"),
    ("models_never_qualify", 'check = "check_prefill_then_decode"\nops = ["prefill 4", "decode 1"]\n'
     'models = ["llama", "mamba"]\nrequires = ["sliding"]', "requires",
     "no model of models = ['llama', 'mamba'] has every feature of requires = ['sliding']: the case would never "
     "run; zoo models that have them: mistral"),
]


def _write(folder, name, lines):
    path = folder / f"{name}.toml"
    path.write_text(f'[[case]]\nid = "mine"\n{lines}\n')
    return path


@pytest.mark.parametrize("name, lines, key, text", WRONG_FOR_CHECK, ids=[w[0] for w in WRONG_FOR_CHECK])
def test_case_wrong_for_its_check_is_a_case_file_error_naming_file_case_key_and_need(tmp_path, registry, name,
                                                                                     lines, key, text):
    path = _write(tmp_path, name, lines)
    with pytest.raises(CaseFileError) as err:
        load_case_file(path, registry)
    assert str(err.value).startswith(f"{path}: case 'mine': key '{key}': "), str(err.value)
    assert text in str(err.value)


LOOP = """
import contextlib, io, json, sys
import pytest
out = []
for path in sys.argv[1:]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        ret = pytest.main(["--kvconform", "-p", "no:cacheprovider", "--kvconform-cases", path,
                           "--kvconform-model", "llama", "--collect-only", "-q"])
    out.append([path, int(ret), err.getvalue()])
print(json.dumps(out))
"""


def test_every_case_wrong_for_its_check_is_a_usage_error_exit_4(pytester):
    """``pytest --kvconform --kvconform-cases FILE`` for each of ``WRONG_FOR_CHECK``: exit code 4 and the message
    naming the file, the case and the key, no traceback. One subprocess runs ``pytest.main`` once per file (the
    import of torch and transformers is paid once; each usage error stops the run before any model is built)."""
    paths = [str(_write(pytester.path, name, lines)) for name, lines, _, _ in WRONG_FOR_CHECK]
    script = pytester.path / "loop.py"
    script.write_text(LOOP)
    proc = subprocess.run([sys.executable, str(script), *paths], capture_output=True, text=True, timeout=600,
                          cwd=pytester.path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(WRONG_FOR_CHECK)
    for (path, ret, err), (name, _, key, text) in zip(results, WRONG_FOR_CHECK):
        assert ret == pytest.ExitCode.USAGE_ERROR, (name, ret, err)
        assert f"{path}: case 'mine': key '{key}': " in err and text in err, (name, err)
        assert "Traceback" not in err, (name, err)


def test_one_wrong_case_is_a_usage_error_in_a_plain_run(run_kvconform, pytester):
    """The same through a plain ``pytest --kvconform`` process (the ``--kvconform-cases`` path end to end)."""
    _write(pytester.path, "crop20", WRONG_FOR_CHECK[[w[0] for w in WRONG_FOR_CHECK].index("crop_past_held")][1])
    result = run_kvconform("--kvconform-cases", "crop20.toml", "--kvconform-model", "llama")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    err = result.stderr.str()
    assert "crop20.toml: case 'mine': key 'ops': op 2 'crop 20' removes 20 tokens from a cache holding 12" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("lines", [
    'check = "check_crop_then_continue"\nops = ["prefill 12", "crop 12", "decode 2"]',  # crop to zero: allowed
    'check = "check_crop_then_continue"\nops = ["prefill 2", "crop 5", "decode 2"]\n'
    'params = {crop_beyond_held = true}',  # the edge case, marked
    'check = "check_crop_then_continue"\nops = ["prefill 4", "crop 6", "decode 2"]\n'
    'params = {positive = true}',  # crop(+6) keeps 6: a length, not tokens removed
    'check = "check_prefill_then_decode"\nops = ["prefill 4", "decode 1", "reset", "prefill 3", "crop 3", "decode 1"]',
    'check = "check_prefill_then_decode"\nops = ["prefill 4", "decode 1"]\nmodels = ["llama", "./my-ckpt"]\n'
    'requires = ["sliding"]',  # a checkpoint's features are known only when it loads
    'check = "check_api_contract"',  # no ops: the check's own default prefill
])
def test_cases_that_fit_their_check_load(tmp_path, registry, lines):
    (case,) = load_case_file(_write(tmp_path, "ok", lines), registry)
    assert case.id == "mine"


def test_crop_beyond_held_is_only_for_the_crop_checks(tmp_path, registry):
    path = _write(tmp_path, "x", 'check = "check_prefill_then_decode"\nops = ["prefill 2", "crop 5", "decode 1"]\n'
                                 'params = {crop_beyond_held = true}')
    with pytest.raises(CaseFileError, match="key 'params.crop_beyond_held': unknown key for check_prefill_then_decode"):
        load_case_file(path, registry)


def test_every_builtin_check_declares_what_it_needs_of_ops_and_builtin_cases_fit(registry, builtin):
    undeclared = sorted(name for name, info in registry.items() if info.ops is None)
    assert not undeclared, f"checks without an OpRule (register(..., ops=...)): {undeclared}"
    by_name = {name: info for name, info in registry.items()}
    full = load_cases(known_checks=registry)  # raises on any built-in case wrong for its check
    assert len(full) == len(builtin)
    assert all(by_name[c.check].case_problem(c) is None for c in full)
    # the one built-in case that crops past the start says so
    assert [c.id for c in full if c.params.get("crop_beyond_held")] == ["crop_more_than_cached"]


def test_spec_messages_use_the_right_article():
    from kvconform.subjects import SpecError, resolve_cache_spec

    with pytest.raises(SpecError, match="VOCAB_SIZE is an int, not a Cache subclass or a factory"):
        resolve_cache_spec("kvconform.zoo:VOCAB_SIZE")
    with pytest.raises(SpecError, match="ZOO_NAMES is a tuple, not a Cache subclass"):
        resolve_cache_spec("kvconform.zoo:ZOO_NAMES")


def test_a_check_owns_its_crop_past_the_start_rule(tmp_path, registry):
    # the held-tokens rule asks the case's check (its OpRule) which params mark a crop past the start as the point
    # of the case: a check of another family declaring its own param is honoured, by that param only
    info = registry["check_crop_then_continue"]
    mine = dataclasses.replace(info, name="check_mine", params={**info.params, "past_on_purpose": info.params[
        "crop_beyond_held"]}, ops=dataclasses.replace(info.ops, crop_past_start="past_on_purpose", crop_keeps=None))
    own = {**registry, "check_mine": mine}
    past = 'check = "check_mine"\nops = ["prefill 2", "crop 5", "decode 2"]'
    (case,) = load_case_file(_write(tmp_path, "ok", past + "\nparams = {past_on_purpose = true}"), own)
    assert case.params["past_on_purpose"] is True
    with pytest.raises(CaseFileError) as err:
        load_case_file(_write(tmp_path, "bad", past + "\nparams = {positive = true}"), own)
    assert ("op 2 'crop 5' removes 5 tokens from a cache holding 2" in str(err.value)
            and "params.past_on_purpose = true" in str(err.value)), str(err.value)


def test_every_bad_case_of_a_file_is_reported_at_once(tmp_path):
    # a case file with three bad cases and a good one: one run names all three (the first line as before)
    path = tmp_path / "mine.toml"
    path.write_text('[[case]]\nid = "a"\ncheck = "check_prefill_then_decode"\nops = "prefill 4"\n\n'
                    '[[case]]\nid = "b"\ncheck = "check_prefill_then_decode"\nops = ["prefill 4", "decod 2"]\n\n'
                    '[[case]]\nid = "good"\ncheck = "check_prefill_then_decode"\nops = ["prefill 4", "decode 2"]\n\n'
                    '[[case]]\nid = "c"\ncheck = "check_prefill_then_decode"\nops = ["prefill 4"]\nbatchh = 2\n')
    with pytest.raises(CaseFileError) as info:
        load_case_file(path)
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"{path}: case 'a': key 'ops'") and "(3 cases with errors)" in lines[0], lines
    assert len(lines) == 3 and "case 'b'" in lines[1] and "case 'c'" in lines[2] and "batchh" in lines[2], lines


def test_every_problem_of_a_bad_case_is_reported_at_once(tmp_path):
    # one case with a bad dtype, a bad batch and a malformed op: the three problems in one message
    path = tmp_path / "mine.toml"
    path.write_text('[[case]]\nid = "a"\ncheck = "check_prefill_then_decode"\nops = ["prefill 0", "decode 2"]\n'
                    'dtype = "float8"\nbatch = 0\n')
    with pytest.raises(CaseFileError) as info:
        load_case_file(path)
    text = str(info.value)
    assert "key 'dtype': 'float8' is not allowed" in text and "key 'batch': must be ≥ 1, got 0" in text, text
    assert "op 'prefill 0' needs one positive count" in text and len(text.splitlines()) == 3, text
