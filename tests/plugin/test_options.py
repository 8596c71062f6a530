"""The option table (``kvconform.options``): a flag is one ``Option`` entry, and what pytest registers, the flags
refused without ``--kvconform`` and a failure's reproduce line are read from that table."""

import os

import pytest

from kvconform import options


def test_every_option_is_registered_from_the_table(pytester):
    config = pytester.parseconfig()
    flags = [option.flag for option in options.OPTIONS]
    assert len(flags) == len(set(flags)) and flags[0] == "--kvconform"
    for option in options.OPTIONS:
        assert option.dest == option.flag.removeprefix("--").replace("-", "_")
        assert config.getoption(option.dest) is None  # registered, not given
        if option.ini is not None:
            assert config.getini(option.dest) == option.ini_default
    assert options.timeout_s(config) == 300.0 and options.opt(config, options.DEVICE) == "cpu"


def test_the_reproduce_line_repeats_what_the_table_marks(pytester):
    config = pytester.parseconfig("--kvconform", "--kvconform-strict", "--kvconform-timeout", "12",
                                  "--kvconform-cases", "extra.toml", "--kvconform-json", "r.json",
                                  "--kvconform-device", "cpu")
    assert options.reproduce_args(config, 7) == (
        "--kvconform-cases", os.path.abspath("extra.toml"), "--kvconform-strict", "--kvconform-timeout", "12",
        "--kvconform-fuzz-seed", "7")  # the JSON path changes no verdict; the default device is not repeated
    assert options.reproduce_args(pytester.parseconfig("--kvconform"), None) == ()


def test_a_kvconform_flag_without_kvconform_is_a_usage_error(pytester):
    config = pytester.parseconfig("--kvconform-json", "r.json", "--kvconform-known-faults", "mine.toml")
    with pytest.raises(pytest.UsageError, match="--kvconform-known-faults, --kvconform-json given without "
                                                "--kvconform"):
        options.refuse_flags_without_kvconform(config)
    options.refuse_flags_without_kvconform(pytester.parseconfig())  # nothing given: nothing refused


def test_one_run_options_value_is_read_from_the_table_and_validated(pytester):
    from kvconform.run_options import RunOptions

    config = pytester.parseconfig("--kvconform", "--kvconform-strict", "--kvconform-timeout", "12",
                                  "--kvconform-fuzz-seed", "7", "--kvconform-power", "off",
                                  "--kvconform-json", "r.json")
    run = options.run_options(config)
    assert (run.strict, run.full, run.device, run.timeout, run.fuzz_seed, run.power) == (True, False, "cpu", 12.0, 7,
                                                                                         "off")
    assert run.reproduce_args == options.reproduce_args(config, 7)
    # every option of the table, also one with no field of its own, by its short name: a new flag needs no more
    assert run.get("json") == "r.json" and run.get("strict") is True and run.get("no_such_flag", 3) == 3
    assert RunOptions().get("json") is None
    with pytest.raises(pytest.UsageError, match="--kvconform-power 'all'"):
        options.run_options(pytester.parseconfig("--kvconform", "--kvconform-power", "all"))


@pytest.mark.parametrize("changes, message", [
    ({"device": "gpu"}, "--kvconform-device 'gpu': kvconform runs on cpu, cuda or cuda:N"),
    ({"timeout": -1}, "--kvconform-timeout -1: must be a number ≥ 0"),
    ({"fuzz_seed": "7"}, "--kvconform-fuzz-seed '7'"),
    ({"power": "all"}, "--kvconform-power 'all': must be one of off, sampled, full"),
    ({"stict": True}, "unknown run option 'stict'; did you mean 'strict'"),
])
def test_a_bad_run_option_is_a_usage_error_naming_it(changes, message):
    from kvconform import check_cache, parametrize_with_checks
    from kvconform.outcomes import UsageError
    from kvconform.run_options import RunOptions

    with pytest.raises(UsageError, match=message):  # the same error from the value and from both entry points
        RunOptions.of(**changes)
    with pytest.raises(UsageError, match=message):
        check_cache([], models=["llama"], **changes)
    with pytest.raises(UsageError, match=message):
        parametrize_with_checks([], models=["llama"], **changes)
    assert RunOptions.of(RunOptions(strict=True), device="cuda:1") == RunOptions(strict=True, device="cuda:1")
