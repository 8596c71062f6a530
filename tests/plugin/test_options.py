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
