"""Case files: each check's ``params`` schema (declared with ``@register``) and the ``models`` entries are validated
at load; every problem is a usage error (exit code 4) naming the file, the case, the key and what is allowed."""

import textwrap

import pytest
import torch  # noqa: F401 - before pytester snapshots sys.modules (see test_plugin.py)

BAD_CASES = [
    # (check, extra TOML lines, text the usage error must contain)
    ("check_beam_search", 'params = {beamz = 3}',
     "key 'params.beamz': unknown key for check_beam_search; did you mean 'beams'? allowed keys: beams, padding"),
    ("check_generate_greedy", "params = {beams = 2}",
     "key 'params.beams': unknown key for check_generate_greedy; check_generate_greedy takes no params"),
    ("check_beam_search", 'params = {beams = "two"}',
     "key 'params.beams': expected int ≥ 2, got str 'two'"),
    ("check_beam_search", 'params = {beams = true}',
     "key 'params.beams': expected int ≥ 2, got bool True"),
    ("check_beam_search", 'params = {beams = 1}',
     "key 'params.beams': 1 is out of range; allowed: int ≥ 2"),
    ("check_reorder_then_decode", 'ops = ["prefill 4", "reorder", "decode 2"]\nparams = {padding = [0, "x"]}',
     "key 'params.padding': expected list of int ≥ 0, got [0, 'x'] (element 'x')"),
    ("check_reorder_then_decode", 'ops = ["prefill 4", "reorder", "decode 2"]\nparams = {padding = [0, -1]}',
     "key 'params.padding': -1 is out of range; allowed: list of int ≥ 0"),
    ("check_prefix_generate", 'ops = ["prefill 4"]\nparams = {mode = "whole"}',
     "key 'params.mode': 'whole' is not allowed; allowed values: 'full_prompt' | 'suffix_only'"),
    ("check_quality_budget", 'ops = ["prefill 4", "decode 2"]\nparams = {top1_min = 1.5}',
     "key 'params.top1_min': 1.5 is out of range; allowed: number in [0, 1]"),
    ("check_quality_budget", 'ops = ["prefill 4", "decode 2"]\nparams = {kl_max = {"4" = 0.1}}',
     "key 'params.kl_max': expected number ≥ 0, got dict {'4': 0.1}"),
    ("check_prefill_then_decode", 'ops = ["prefill 4", "decode 2"]\nmodels = ["lama"]',
     "key 'models': 'lama' is not a zoo name; did you mean 'llama'? zoo names: llama, mistral"),
]


def _ids(cases):
    return [f"{check}-{text.split(': ')[1].split()[0]}" for check, _, text in cases]


@pytest.mark.parametrize("check, lines, text", BAD_CASES, ids=_ids(BAD_CASES))
def test_bad_params_and_models_are_case_file_errors_naming_file_case_key_and_allowed(tmp_path, check, lines, text):
    from kvconform.cases import CaseFileError, load_cases
    from kvconform.checks import load_checks

    path = tmp_path / "mycases.toml"
    path.write_text(f'[[case]]\nid = "mine"\ncheck = "{check}"\n{lines}\n')
    with pytest.raises(CaseFileError) as err:
        load_cases([path], known_checks=load_checks())
    assert f"mycases.toml: case 'mine': {text}" in str(err.value)


@pytest.mark.parametrize("check, lines, text", [BAD_CASES[0], BAD_CASES[-1]], ids=_ids([BAD_CASES[0], BAD_CASES[-1]]))
def test_bad_params_and_models_are_usage_errors(run_kvconform, pytester, check, lines, text):
    pytester.makefile(".toml", mycases=f'[[case]]\nid = "mine"\ncheck = "{check}"\n{lines}\n')
    result = run_kvconform("--kvconform-cases", "mycases.toml", "--kvconform-model", "llama")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    err = result.stderr.str()
    assert f"mycases.toml: case 'mine': {text}" in err and "Traceback" not in err, err


def test_bad_params_in_defaults_table_name_the_case(tmp_path):
    from kvconform.cases import CaseFileError, load_case_file
    from kvconform.checks import load_checks

    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent("""
        [defaults]
        params = {forks = 0}

        [[case]]
        id = "fork0"
        check = "check_prefix_fork"
        ops = ["prefill 4", "fork", "decode 1"]
    """))
    with pytest.raises(CaseFileError, match=r"case 'fork0': key 'params.forks': 0 is out of range; allowed: int ≥ 1"):
        load_case_file(path, load_checks())


def test_defaults_filled_and_checkpoint_paths_named_like_the_run_names_them(tmp_path):
    from kvconform.cases import load_case_file
    from kvconform.checks import load_checks
    from kvconform.zoo import checkpoint_name

    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent("""
        [[case]]
        id = "beams"
        check = "check_beam_search"
        models = ["llama", "./ckpt/my-model", "./llama"]

        [[case]]
        id = "speed"
        check = "check_speed_flat_decode"
        params = {max_growth = 2.5, repeats = 7}
    """))
    beams, speed = load_case_file(path, load_checks())
    assert beams.params == {"beams": 2}  # padding has no default: absent means no padding
    assert beams.models == ("llama", "my_model", "ckpt_llama") == ("llama", checkpoint_name("x/my-model"),
                                                                   checkpoint_name("./llama"))
    assert speed.params == {"max_growth": 2.5, "max_growth_quantized_share": 1.0, "repeats": 7, "steps": 4,
                            "warmup": 1, "threads": 1,
                            "uncached_steps": 1, "short": 128, "long": 1024}
    # without the registry (a set of names, or None) params are not checked nor filled
    (plain,) = [c for c in load_case_file(path, {"check_beam_search", "check_speed_flat_decode"}) if c.id == "beams"]
    assert plain.params == {}


def test_every_builtin_case_satisfies_its_checks_schema_and_rules_live_in_the_registry():
    from kvconform.cases import load_cases
    from kvconform.checks import load_checks

    registry = load_checks()
    cases = load_cases(known_checks=registry)  # raises CaseFileError on any violation
    assert {c.check for c in cases} <= set(registry)
    # no applies= rule selects a kind: the checks that need a fact of the subject's kind name it (facts=)
    facts = {name: tuple(info.facts) for name, info in registry.items() if info.facts}
    assert facts == {"check_generate_vs_twin": ("has_twin",), "check_reorder_after_flush": ("quantized",),
                     "check_quality_budget": ("lossy",), "check_compression_real": ("compresses",)}
    quality = {name: getattr(info.applies, "__name__", None) for name, info in registry.items()
               if info.family == "quality"}
    assert quality == {"check_quality_budget": "_declares_no_budget", "check_compression_real": "_compression_judged",
                       "check_memory_bound": None}  # evicting subjects only: judges=(EVICTING,)
    assert not [name for name, info in registry.items() if hasattr(info.fn, "kvconform_applies")]


def test_params_are_built_once_at_load_typed_with_every_default_from_the_schema():
    """``case.params`` is a ``cases.Params`` built from the check's schema: each key of its type (a number key
    given as an int is a float), each omitted key's default filled in from the schema (the one place it is
    written), read as attributes with no re-cast; a key outside the schema is an AttributeError."""
    from kvconform.cases import Params, load_cases
    from kvconform.checks import load_checks

    registry = load_checks()
    cases = load_cases(known_checks=registry)
    for case in cases:
        schema = registry[case.check].params
        assert isinstance(case.params, Params)
        for key, param in schema.items():
            value = getattr(case.params, key)
            if key not in case.params:
                assert value is None and param.default is None, (case.id, key)
            elif set(param.types) == {float}:  # a number key; a union such as (str, float) keeps the case's type
                assert isinstance(value, float), (case.id, key, value)
    speed = next(c for c in cases if c.check == "check_speed_vs_uncached")
    assert isinstance(speed.params.min_speedup, float) and isinstance(speed.params.context, int)
    identity = next(c for c in cases if c.check == "check_identity_ops")
    assert identity.params.decode == registry["check_identity_ops"].params["decode"].default
    with pytest.raises(AttributeError, match="no key 'decoed'"):
        identity.params.decoed  # noqa: B018 - the read is the test
    assert dict(Params({"a": 1})) == {"a": 1} and Params({"a": 1}).a == 1


def test_one_dtype_table_is_read_by_cases_oracle_and_reports():
    from kvconform import cases, oracle, report

    assert cases.DTYPES == tuple(oracle.DTYPES) == report._DTYPE_ORDER
    assert {n: d.short for n, d in oracle.DTYPES.items()} == {"float32": "fp32", "float64": "fp64",
                                                               "bfloat16": "bf16", "float16": "fp16"}
    assert oracle.dtype_tolerance("bfloat16") == oracle.DTYPES["bfloat16"].tolerance
    assert (oracle.DTYPES["bfloat16"].exact_integers, oracle.DTYPES["float16"].exact_integers) == (256, 2048)
