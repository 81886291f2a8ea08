"""Model dtypes: the ones a model runs in are taken by name, others refused in one line before anything loads."""

from __future__ import annotations

import pytest

import statekv
from statekv.settings.options import ModelOptions


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_a_float8_dtype_is_refused_in_one_line_before_the_model_loads(dtype):
    with pytest.raises(statekv.ConfigurationError, match=f"dtype '{dtype}' is not one a model runs in") as info:
        ModelOptions(model="builtin", dtype=dtype)
    assert "\n" not in str(info.value)
