"""`ModelOptions` is made from one table: a new option is one `Setting` entry, and it is a dataclass field, a
command-line flag and a text option, and it is checked, with no other edit."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from statekv.settings.options import BUILTIN_BUDGET
from statekv.errors import ConfigurationError
from statekv.flops import Method
from statekv.settings.methods import MethodSettings
from statekv.settings.options import SETTINGS, ModelOptions
from statekv.settings.setting import Setting, settings_class
from statekv.settings.values import POSITIVE


@settings_class(SETTINGS + (Setting("beams", 1, POSITIVE, "answers searched per question (default: %(default)s)",
                                   "K"),))
class WithBeams(ModelOptions):
    """ModelOptions plus one option, added as one table entry."""


def _parser(options: type[ModelOptions]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="statekv", exit_on_error=False)
    options.add_arguments(parser)
    return parser


def test_a_new_table_entry_is_a_field_a_flag_a_text_option_and_checked():
    assert [f.name for f in fields(WithBeams)] == [f.name for f in fields(ModelOptions)] + ["beams"]
    beams = fields(WithBeams)[-1]
    assert (beams.default, beams.type) == (1, "int") and WithBeams().beams == 1

    parser = _parser(WithBeams)
    assert "--beams K" in parser.format_help() and "answers searched per question (default: 1)" in parser.format_help()
    options = WithBeams.from_args(parser.parse_args(["--model", "m", "--beams", "3", "--budget", "8"]))
    assert (options.beams, options.budget, options.settings) == (3, 8, MethodSettings(budget=8))
    with pytest.raises(argparse.ArgumentError, match="argument --beams: expected a positive integer, got '0'"):
        parser.parse_args(["--model", "m", "--beams", "0"])
    with pytest.raises(argparse.ArgumentError, match="argument --beams: expected a positive integer at most "
                                                     "281,474,976,710,656, got '100000000000000000000'"):
        parser.parse_args(["--model", "m", "--beams", "100000000000000000000"])  # an integer, past the largest taken

    assert WithBeams.from_strings({"beams": " 4 ", "offload": "on"}).beams == 4
    with pytest.raises(ConfigurationError, match="beams must be at least 1, got '0'"):
        WithBeams.from_strings({"beams": "0"})
    with pytest.raises(ConfigurationError, match="beams must be a positive integer, got 0"):
        WithBeams(beams=0)
    with pytest.raises(ConfigurationError, match="beams must be a positive integer, got '2'"):
        WithBeams().with_changes(beams="2")

    # the original class is untouched
    assert "beams" not in {f.name for f in fields(ModelOptions)} and "--beams" not in _parser(ModelOptions).format_help()
    with pytest.raises(ConfigurationError, match="unknown option beams; known: model, method"):
        ModelOptions.from_strings({"beams": "4"})


def test_every_field_flag_and_text_option_comes_from_the_table():
    names = [setting.name for setting in SETTINGS]
    assert [f.name for f in fields(ModelOptions)] == names
    assert [option.name for option in ModelOptions.string_options()] == names
    assert [f.default for f in fields(ModelOptions)] == [setting.default for setting in SETTINGS]
    flags = {action.dest for action in _parser(ModelOptions)._actions} - {"help"}
    assert flags == set(names)
    reserved = argparse.ArgumentParser()
    ModelOptions.add_arguments(reserved, reserve=False)
    assert {action.dest for action in reserved._actions} == flags - {"reserve_tokens"} | {"help"}


def test_the_method_sizes_take_their_defaults_and_checks_from_method_settings():
    assert ModelOptions().settings == MethodSettings()
    for size in fields(MethodSettings):
        assert getattr(ModelOptions(), size.name) == size.default
    with pytest.raises(ConfigurationError, match=r"frames \(the recency window R\) must be a positive integer"):
        ModelOptions(frames=0)
    with pytest.raises(ConfigurationError, match="sinks must be a non-negative integer, got -1"):
        ModelOptions(sinks=-1)
    assert ModelOptions(sinks=0).settings.sinks == 0


def test_the_built_in_model_gets_its_own_budget_when_none_is_given_everywhere():
    assert (ModelOptions(model="builtin").budget, ModelOptions(model="ckpt").budget) == (BUILTIN_BUDGET, 4096)
    assert ModelOptions(model="builtin", budget=4096).budget == 4096  # given: kept, even the engine's default
    assert ModelOptions.from_strings({"model": "builtin"}).settings == MethodSettings(budget=BUILTIN_BUDGET)
    assert ModelOptions.from_args(_parser(ModelOptions).parse_args(["--model", "builtin"])).budget == BUILTIN_BUDGET
    assert ("(default: 64 for the built-in model and weights trained by train-builtin, else 4096)"
            in " ".join(_parser(ModelOptions).format_help().split()))
    assert ModelOptions.given(model="builtin", method="recency").budget == BUILTIN_BUDGET  # not given: not refused
    with pytest.raises(ConfigurationError, match="budget=4096 is not used by method='recency'"):
        ModelOptions.given(model="builtin", method="recency", budget=4096)
    with pytest.raises(ConfigurationError, match="budget must be a positive integer, got 0"):
        ModelOptions(model="builtin", budget=0)


def test_the_flops_method_sizes_are_method_settings():
    assert Method("rekv", frames=8, sinks=0).settings == MethodSettings(frames=8, sinks=0)
    with pytest.raises(ConfigurationError, match="sinks must be a non-negative integer, got -1"):
        Method("rekv", frames=8, sinks=-1)
    with pytest.raises(ConfigurationError, match="statekv's budget must be a positive integer, got None"):
        Method("statekv")
    with pytest.raises(ConfigurationError, match="statekv takes no sinks"):
        Method("statekv", budget=4, sinks=2)
