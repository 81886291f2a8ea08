"""Plausible misuses of the public Python API, each refused with a one-line statekv error where it is made,
not with a traceback from deep inside a later call."""

from __future__ import annotations

import pytest
import torch

import statekv
from conftest import random_frames
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


@pytest.fixture
def forget_methods():
    from statekv.settings.methods import METHODS

    before = dict(METHODS)
    yield
    METHODS.clear()
    METHODS.update(before)


def test_a_method_that_is_no_method_is_refused_when_registered(forget_methods):
    from statekv.settings.methods import MethodSpec, at_most_budget

    def spec(**changes):
        fields = {"name": "mine", "summary": "mine", "size": "budget",
                  "policy": lambda settings, frames: statekv.KeyNorm(budget=settings.budget),
                  "history": at_most_budget, "display": "Mine", **changes}
        return MethodSpec(**fields)

    with pytest.raises(statekv.ConfigurationError, match="register_method takes a MethodSpec, got str"):
        statekv.register_method("mine")
    with pytest.raises(statekv.ConfigurationError, match="'budgets' is no method setting; .* budget, frames"):
        statekv.register_method(spec(size="budgets"))
    with pytest.raises(statekv.ConfigurationError, match="'retrieve' is no method setting"):
        statekv.register_method(spec(also_uses=("retrieve",)))
    with pytest.raises(statekv.ConfigurationError, match="policy must be a function .* got KeyNorm"):
        statekv.register_method(spec(policy=statekv.KeyNorm(budget=4)))
    with pytest.raises(statekv.ConfigurationError, match="name must be non-empty text"):
        statekv.register_method(spec(name=""))
    assert statekv.make_policy(statekv.register_method(spec()).name, budget=8) == statekv.KeyNorm(budget=8)


def test_a_registered_policy_function_that_makes_no_policy_is_refused_by_name(forget_methods):
    from statekv.settings.methods import MethodSpec, at_most_budget

    statekv.register_method(MethodSpec("mine", "mine", "budget", lambda settings, frames: statekv.KeyNorm,
                                       at_most_budget, "Mine"))  # the class, not made
    with pytest.raises(statekv.ConfigurationError, match="method 'mine': its policy function returned type, not a"):
        statekv.make_policy("mine")


@pytest.mark.parametrize("make, message", [
    (lambda: statekv.WithSinks("statekv", 4), "WithSinks: rule must be a CarryPolicy, got str"),
    (lambda: statekv.WithSinks(statekv.StateKV, 4), "WithSinks: rule must be a CarryPolicy, got type"),
    (lambda: statekv.PerLayerBudget(statekv.Recency(frames=2), (4, 4)),
     "PerLayerBudget: rule must be a ScoredPolicy, got Recency"),
])
def test_a_wrapping_rule_is_refused_what_is_no_rule_as_every_rule_argument_is(make, message):
    with pytest.raises(statekv.ConfigurationError, match=message):
        make()


def test_a_state_given_as_a_list_of_tensors_is_refused_in_one_line(tiny_lm):
    model = tiny_lm("qwen2", num_hidden_layers=2)
    streamed = statekv.StreamingPrefill(model, statekv.StateKV(budget=4), horizon=64)
    streamed.step(input_ids=torch.tensor([[1, 2, 3]]))
    tensors, metadata = streamed.state_dict()
    resumed = statekv.StreamingPrefill(model, statekv.StateKV(budget=4), horizon=64)
    with pytest.raises(statekv.InputError, match=r"^the saved tensors must be a mapping .* got list$"):
        resumed.load_state_dict(list(tensors.values()), metadata)
    resumed.load_state_dict(tensors, metadata)
    assert resumed.seen_tokens == 3


def test_a_horizon_is_planned_only_for_a_count_of_frames(adapter):
    qa = statekv.VideoQA(adapter, statekv.StateKV(budget=8))
    for frames in ("16", 2.5, -1):
        with pytest.raises(statekv.ConfigurationError, match="num_frames must be a non-negative integer, got"):
            qa.horizon_for(frames)
    assert qa.horizon_for(16) > qa.horizon_for(0) >= qa.reserve_tokens and qa.horizon_for(None) is None


@pytest.mark.parametrize("score, got", [
    (lambda c: c.keys.float().norm(dim=-1)[..., 1:], r"got shape \(1, \d+, 9\)$"),  # before: scores a place off, kept
    (lambda c: 1.0, "got float$"),
    (lambda c: c.scores, "got NoneType; a rule that reads candidates.scores declares needs_scores = True$"),
])
def test_a_written_rule_whose_score_is_not_one_per_candidate_is_refused_in_one_line(tiny_lm, score, got):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Written(statekv.ScoredPolicy):
        def score(self, candidates):
            return score(candidates)

    model = tiny_lm("qwen2", num_hidden_layers=2)
    streamed = statekv.StreamingPrefill(model, Written(budget=8), horizon=64)
    streamed.step(input_ids=torch.tensor([[1, 2, 3, 4, 5]]))  # five candidates: all carried, none scored
    with pytest.raises(statekv.InputError, match=r"^Written.score must return one score per candidate, a tensor of "
                                                  r"shape \(1, \d+, 10\) \[B, H_kv, N\]; " + got):
        streamed.step(input_ids=torch.tensor([[6, 7, 8, 9, 10]]))


@pytest.mark.parametrize("scores, got", [
    (lambda seen: torch.arange(50.0), r"got shape \(50,\)$"),  # before: taken, whatever it scored
    (lambda seen: torch.zeros(3), r"got shape \(3,\)$"),
    (lambda seen: 1.0, "got float$"),
])
def test_a_written_retrieval_rule_whose_scores_are_not_one_per_step_is_refused_in_one_line(tiny_lm, scores, got):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Written(statekv.RetrievalRule):
        def scores(self, seen):
            return scores(seen)

    model = tiny_lm("qwen2", num_hidden_layers=2)
    streamed = statekv.StreamingPrefill(model, statekv.StateKV(budget=4), horizon=128)
    for first in range(1, 60, 5):  # twelve steps
        streamed.step(input_ids=torch.arange(first, first + 5)[None])
    with pytest.raises(statekv.InputError, match=r"^Written.scores must return one score per step of the stream, "
                                                  r"a tensor of shape \(12,\); " + got):
        streamed.generate(torch.tensor([[1, 2]]), max_new_tokens=2, retrieve=statekv.Retrieval(3, 0, Written()))


def _image_of_a_closed_file():
    import io

    import numpy as np
    from PIL import Image

    data = io.BytesIO()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(data, format="PNG")
    data.seek(0)
    image = Image.open(data)  # lazy: its pixels are read when first used
    data.close()
    return image


def test_a_pil_image_whose_file_was_closed_is_refused_in_one_line_pushed_or_encoded(adapter):
    qa = statekv.VideoQA(adapter, statekv.StateKV(budget=8), attention="eager", reserve_tokens=40)
    message = r"^a PIL image whose pixels cannot be read: I/O operation on closed file\. \(PIL reads"
    with qa.stream(horizon_frames=4, max_fps=None) as stream:
        with pytest.raises(statekv.InputError, match=message):
            stream.push(_image_of_a_closed_file(), 0.0)
        assert stream.pushed == 0
    with pytest.raises(statekv.StateKVError, match=message):
        qa.encode([_image_of_a_closed_file()])


@pytest.mark.parametrize("misspelt, meant", [("retreive", "retrieve"), ("retrival", "retrieval"),
                                             ("max_new_token", "max_new_tokens"), ("temprature", "temperature")])
def test_a_misspelt_ask_argument_is_refused_naming_the_one_meant(adapter, misspelt, meant):
    stream = statekv.VideoQA(adapter, statekv.StateKV(budget=8), reserve_tokens=40).stream(4)
    stream.push(random_frames(1)[0])
    with pytest.raises(statekv.InputError, match=f"'{misspelt}'; did you mean {meant}\\?") as info:
        stream.ask("Why?", **{misspelt: 2})
    assert "\n" not in str(info.value)
    with pytest.raises(statekv.InputError, match="unknown generation argument 'zzz' \\(see") as info:
        stream.ask("Why?", zzz=2)  # nothing close: no guess
    stream.close()
