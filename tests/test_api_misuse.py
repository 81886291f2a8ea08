"""Plausible misuses of the public Python API, each refused with a one-line statekv error where it is made,
not with a traceback from deep inside a later call."""

from __future__ import annotations

import pytest
import torch

import statekv
from statekv.models import load_adapter


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, dtype=torch.float32)


def test_a_videoqa_is_refused_a_method_name_or_a_policy_class_for_its_policy(adapter):
    for policy, shown in (("statekv", "got str"), (statekv.StateKV, "got type")):
        with pytest.raises(statekv.ConfigurationError, match=f"policy must be a CarryPolicy .*make_policy.*{shown}"):
            statekv.VideoQA(adapter, policy)
    assert statekv.VideoQA(adapter, statekv.make_policy("statekv", budget=8)).policy == statekv.StateKV(budget=8)


def test_a_videoqa_is_refused_a_checkpoints_name_for_its_adapter():
    with pytest.raises(statekv.ConfigurationError, match=r"got str; VideoQA.from_pretrained\(name\) loads"):
        statekv.VideoQA("builtin", statekv.StateKV(budget=8))
