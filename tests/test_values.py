"""Strict option parsing (statekv.settings.values): what lmms-eval's --model_args strings may say, and refusals."""

from __future__ import annotations

import math

import pytest

from statekv.errors import ConfigurationError
from statekv.settings.values import (LARGEST_INT, Option, boolean, byte_size, check_int, check_number, choice, integer,
                                     is_finite_number, optional_text, parse_options, positive_float,
                                     positive_int, required_text)


@pytest.mark.parametrize("text", ["true", "TRUE", "True", "1", "yes", "Yes", "on", "ON", " on "])
def test_true_words(text):
    assert boolean(text, "offload") is True


@pytest.mark.parametrize("text", ["false", "FALSE", "0", "no", "NO", "off", "Off"])
def test_false_words(text):
    assert boolean(text, "offload") is False


def test_booleans_as_lmms_eval_converts_them():
    assert [boolean(value, "x") for value in (True, False, 1, 0)] == [True, False, True, False]


@pytest.mark.parametrize("value", ["", "nein", "y", "t", "2", "truee", 2, -1, 0.5, None, [], "none"])
def test_anything_else_is_not_a_boolean(value):
    with pytest.raises(ConfigurationError) as error:
        boolean(value, "trust_remote_code")
    message = str(error.value)
    assert message == f"trust_remote_code must be a boolean (true/false, 1/0, yes/no, on/off), got {value!r}"


def test_integers():
    assert [integer(v, "n") for v in (3, "3", " 42 ", 7.0, "-2")] == [3, 3, 42, 7, -2]
    assert positive_int("4096", "budget") == 4096
    for value, message in [("4k", "must be an integer, got '4k'"), (2.5, "must be an integer"),
                           (True, "must be an integer, got True"), (None, "must be an integer"),
                           (0, "must be at least 1, got 0"), ("-3", "must be at least 1, got '-3'")]:
        with pytest.raises(ConfigurationError, match=f"^budget {message}"):
            positive_int(value, "budget")


def test_positive_floats():
    assert [positive_float(v, "fps") for v in (1, 0.5, "2", " 0.25 ", "1e-1")] == [1.0, 0.5, 2.0, 0.25, 0.1]
    for value in (0, "-1", "fast", math.inf, "nan", True, None):
        with pytest.raises(ConfigurationError, match="^fps must be"):
            positive_float(value, "fps")


def test_texts_and_choices():
    assert [optional_text(v, "layout") for v in (None, "", "None", "NULL", " chat ")] == [None, None, None, None,
                                                                                          "chat"]
    with pytest.raises(ConfigurationError, match="layout must be a string, got 3"):
        optional_text(3, "layout")
    with pytest.raises(ConfigurationError, match="pretrained must not be empty"):
        required_text("None", "pretrained")
    method = choice(("statekv", "full"))
    assert method(" full ", "method") == "full"
    with pytest.raises(ConfigurationError, match="method must be one of statekv, full, got 'Full'"):
        method("Full", "method")


def test_parse_options_fills_defaults_and_refuses_unknown_names():
    spec = [Option("budget", positive_int, 4096), Option("offload", boolean, False), Option("layout", optional_text)]
    assert parse_options({"offload": "on"}, spec) == {"budget": 4096, "offload": True, "layout": None}
    assert parse_options({}, spec) == {"budget": 4096, "offload": False, "layout": None}
    with pytest.raises(ConfigurationError) as error:
        parse_options({"bugdet": 1, "ofload": 1, "budget": 2}, spec, what="model arg")
    assert str(error.value) == "unknown model args bugdet, ofload; known: budget, offload, layout"
    with pytest.raises(ConfigurationError, match="^budget must be at least 1"):
        parse_options({"budget": "0"}, spec)


def test_numbers_no_float_holds_and_integers_past_any_size_are_one_line_refusals():
    """Before: a Python or JSON int past a float's range raised OverflowError out of every finite-number check
    (``math.isfinite``), and integers had no upper bound (a stream made with sinks 2**63 failed at every question)."""
    huge = 10**400
    for check in (lambda value: check_number(value, "fps"), lambda value: positive_float(value, "fps")):
        with pytest.raises(ConfigurationError, match=r"^fps must be .*, got 1000000000.*\.\.\.$"):
            check(huge)
    assert not is_finite_number(huge) and not is_finite_number(-huge) and is_finite_number(2**1000)
    assert [is_finite_number(value) for value in (True, "1", None, math.nan, 1.5, -3)] == [False] * 4 + [True] * 2
    assert check_int(LARGEST_INT, "budget") == LARGEST_INT == 2**48
    for value in (LARGEST_INT + 1, 2**63, huge):
        with pytest.raises(ConfigurationError, match=r"^budget must be at most 281,474,976,710,656, got \d"):
            check_int(value, "budget")
        with pytest.raises(ConfigurationError, match="^budget must be at most"):
            positive_int(str(value), "budget")
    with pytest.raises(ConfigurationError, match="^budget must be at most"):
        positive_int(1e300, "budget")
    with pytest.raises(ConfigurationError, match="^max_cache_bytes must be at most 256 TiB, got '1e9T'$"):
        byte_size("1e9T", "max_cache_bytes")
    with pytest.raises(ConfigurationError, match=r"^budget must be a positive integer, got an integer of 16,610 bits$"):
        check_int(-(10**5000), "budget")  # too long for Python to write out
