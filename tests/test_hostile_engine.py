"""The engine's own API used as a hostile user would (`StreamingPrefill` on a Hugging Face decoder, its policies and
`StepBatcher`): each bad call is one line naming the problem, and leaves the stream exactly as it was."""

from __future__ import annotations

import threading

import pytest
import torch

import statekv
from statekv.core.step.batching import StepBatcher, StepRequest
from statekv.errors import ConfigurationError, InputError, QuestionTooLong


@pytest.fixture(scope="module")
def model(tiny_lm):
    return tiny_lm("qwen2", num_hidden_layers=2)


def _chunk(model, seed: int, tokens: int = 3, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, model.config.hidden_size, generator=generator)


def _streamed(model, steps: int = 5, policy=None, **options) -> statekv.StreamingPrefill:
    prefill = statekv.StreamingPrefill(model, policy or statekv.StateKV(budget=8), horizon=200, **options)
    for seed in range(steps):
        prefill.step(inputs_embeds=_chunk(model, seed))
    return prefill


def _same_state(a: statekv.StreamingPrefill, b: statekv.StreamingPrefill) -> bool:
    (tensors_a, meta_a), (tensors_b, meta_b) = a.state_dict(), b.state_dict()
    return meta_a == meta_b and tensors_a.keys() == tensors_b.keys() and all(
        torch.equal(tensors_a[name], tensors_b[name]) for name in tensors_a)


@pytest.mark.parametrize("argument", [{"return_dict": False}, {"use_cache": False}, {"past_key_values": None},
                                      {"cache_position": torch.arange(3)}], ids=lambda a: next(iter(a)))
def test_an_argument_the_step_sets_itself_is_refused_and_the_stream_goes_on_unchanged(model, argument):
    """Before: ``return_dict=False`` failed after the step's device commit, with a traceback; the stream counted
    the refused step on the device and every later step and answer was wrong."""
    taken, twin = _streamed(model), _streamed(model)
    with pytest.raises(InputError, match=f"^{next(iter(argument))} is the engine's own"):
        taken.step(inputs_embeds=_chunk(model, 99), **argument)
    assert _same_state(taken, twin)
    for seed in range(5, 8):
        assert torch.equal(taken.step(inputs_embeds=_chunk(model, seed)), twin.step(inputs_embeds=_chunk(model, seed)))


def test_a_forward_that_returns_no_hidden_states_leaves_the_stream_as_it_was(model):
    """The step reads the decoder's hidden states before it commits: a forward whose output has none (a hook
    that changed it) fails the step while it can still be rolled back."""
    taken, twin = _streamed(model), _streamed(model)
    handle = taken.decoder.register_forward_hook(lambda module, args, output: (output.last_hidden_state,))
    try:
        with pytest.raises(AttributeError):
            taken.step(inputs_embeds=_chunk(model, 99))
    finally:
        handle.remove()
    assert _same_state(taken, twin)
    assert torch.equal(taken.step(inputs_embeds=_chunk(model, 5)), twin.step(inputs_embeds=_chunk(model, 5)))


def test_a_stream_stepped_from_a_second_thread_meanwhile_refuses_that_step(model):
    """Before: two threads stepping one stream interleaved their writes to its cache (blocks of it matched no
    chunk) and failed with messages that named other causes."""
    prefill, twin = _streamed(model), _streamed(model)
    inside, release = threading.Event(), threading.Event()

    def hold(module, args, output):
        inside.set()
        release.wait(10)
    handle = prefill.decoder.register_forward_hook(hold)
    first = threading.Thread(target=prefill.step, kwargs={"inputs_embeds": _chunk(model, 5)})
    first.start()
    try:
        assert inside.wait(10)
        handle.remove()
        with pytest.raises(InputError, match="taking a step in another thread"):
            prefill.step(inputs_embeds=_chunk(model, 6))
    finally:
        handle.remove()  # the model is the module's: no hook outlives the test
        release.set()
        first.join(10)
    twin.step(inputs_embeds=_chunk(model, 5))
    assert _same_state(prefill, twin)
    assert torch.equal(prefill.step(inputs_embeds=_chunk(model, 6)), twin.step(inputs_embeds=_chunk(model, 6)))


def test_non_finite_inputs_are_refused_before_they_reach_the_cache(model):
    """Before: one NaN in one chunk was carried into every later step and answer (each answer all zeros)."""
    prefill, twin = _streamed(model), _streamed(model)
    for bad in (float("nan"), float("inf")):
        chunk = _chunk(model, 99)
        chunk[0, 1, 2] = bad
        with pytest.raises(InputError, match="^inputs_embeds hold NaN or infinite values"):
            prefill.step(inputs_embeds=chunk)
    assert _same_state(prefill, twin)


def test_odd_batches_are_one_line(model):
    prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=8), horizon=200)
    with pytest.raises(InputError, match="^inputs_embeds has batch size 0"):
        prefill.step(inputs_embeds=_chunk(model, 0, batch=0))
    prefill.step(inputs_embeds=_chunk(model, 0))
    with pytest.raises(InputError, match="^the prompt has batch size 2, but the stream has 1"):
        prefill.generate(torch.tensor([[1, 2], [3, 4]]), max_new_tokens=2)
    with pytest.raises(InputError, match="^StepBatcher.step takes StepRequest"):
        StepBatcher().step([prefill])
    assert StepBatcher().step([StepRequest(prefill, _chunk(model, 1))])[0].shape[1] == 3


@pytest.mark.parametrize("room", ["enough", "too little"])
def test_answer_lengths_are_checked_before_the_room_is(model, room):
    """Before: ``max_new_tokens=0`` was read as the default of 64 by the room check, so with too little room it
    was called too long; 1.5 and True were taken; ``max_length`` was not counted by the room check."""
    prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=8), horizon=200 if room == "enough" else 30)
    for seed in range(4):
        prefill.step(inputs_embeds=_chunk(model, seed))
    question = torch.tensor([[1, 2, 3, 4]])
    for bad in (0, 1.5, True):
        with pytest.raises(InputError, match=f"^ask\\(\\): max_new_tokens must be a positive integer, got {bad}$"):
            prefill.generate(question, max_new_tokens=bad)
    with pytest.raises(InputError, match="return_dict_in_generate must be False"):
        prefill.generate(question, return_dict_in_generate=True, output_scores=True)
    assert prefill.generate(question, max_length=6).shape[1] == 2  # prompt and answer
    if room == "too little":
        with pytest.raises(QuestionTooLong, match=r"answer \(36\)"):
            prefill.generate(question, max_length=40)


def test_a_stream_with_no_step_and_odd_layers_are_one_line(model):
    """Before: ``state_dict()`` and ``carried(0)`` of a stream with no step raised a TypeError, and a layer past
    the model's an IndexError."""
    empty = statekv.StreamingPrefill(model, statekv.StateKV(budget=8), horizon=200)
    for call in (empty.state_dict, lambda: empty.carried(0), lambda: empty.carried_positions(0)):
        with pytest.raises(InputError, match="has taken no step yet"):
            call()
    streamed = _streamed(model)
    assert streamed.carried(-1)[0].shape[2] == 8
    for layer in (2, -3, 1.0, True):
        with pytest.raises(InputError, match="layer must be an index of the model's 2 layers"):
            streamed.carried_positions(layer)


def test_a_state_is_refused_by_a_closed_stream_and_by_one_too_short_for_it(model):
    """Before: both took it (a closed stream silently; a 20-token horizon held 15 tokens past it)."""
    tensors, metadata = _streamed(model, steps=12).state_dict()
    closed = statekv.StreamingPrefill(model, statekv.StateKV(budget=8), horizon=200)
    closed.close()
    with pytest.raises(InputError, match="closed"):
        closed.load_state_dict(tensors, metadata)
    short = statekv.StreamingPrefill(model, statekv.StateKV(budget=8), horizon=20)
    with pytest.raises(InputError, match="^the state holds 36 tokens, past this stream's horizon of 20"):
        short.load_state_dict(tensors, metadata)
    assert short.seen_tokens == 0
    resumed = statekv.StreamingPrefill(model, statekv.StateKV(budget=8), horizon=200)
    resumed.load_state_dict(tensors, metadata)
    assert resumed.seen_tokens == 36


def test_settings_a_stream_cannot_use_are_refused_when_it_is_made(model):
    """Before: a `PerLayerBudget` of too few budgets failed at the first step, and ``offload="cuda"`` on a machine
    without one failed in torch with an `AssertionError`."""
    for budgets in ((5,), (5, 6, 7)):
        with pytest.raises(ConfigurationError, match=f"PerLayerBudget has {len(budgets)} budgets, but the model "
                                                     "streams 2 layers"):
            statekv.StreamingPrefill(model, statekv.PerLayerBudget(statekv.StateKV(budget=8), budgets))
    with pytest.raises(ConfigurationError, match="budgets must be one integer per layer, got int"):
        statekv.PerLayerBudget(statekv.StateKV(budget=8), 4)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigurationError, match="offload='cuda': this machine has no such device"):
            statekv.StreamingPrefill(model, statekv.StateKV(budget=8), offload="cuda")


def test_the_room_a_question_takes_is_the_answer_transformers_will_give(model, monkeypatch):
    """Under a model's own ``max_new_tokens`` (which transformers takes before a ``max_length`` passed), the room
    check counts that, not what ``max_length`` leaves: the answer never runs past the horizon. ``None`` is a
    setting not given."""
    prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=8), horizon=40)
    for seed in range(4):
        prefill.step(inputs_embeds=_chunk(model, seed))
    question = torch.tensor([[1, 2, 3, 4]])
    assert prefill.generate(question, max_new_tokens=None, max_length=6).shape[1] == 2
    monkeypatch.setattr(model.generation_config, "max_new_tokens", 30)
    with pytest.raises(QuestionTooLong, match=r"answer \(30\).*declare a longer horizon \(a VideoQA: a larger "):
        prefill.generate(question, max_length=10)  # the engine's remedy first (it had the VideoQA's alone)


@pytest.mark.parametrize("positions, message", [([[-1, 0, 1]], "^position_ids must be at least 0, got -1$"),
                                                ([[198, 199, 200]], "^position_ids reach 200, past the stream's "
                                                                    r"horizon of 200 tokens \(positions 0 to 199\)$")],
                         ids=["negative", "past the horizon"])
def test_explicit_positions_outside_the_stream_are_refused_and_the_stream_goes_on_unchanged(model, positions, message):
    """Before: a negative position or one past the horizon was rotated as given (the horizon's RoPE frozen short of
    it), silently."""
    taken, twin = _streamed(model), _streamed(model)
    with pytest.raises(InputError, match=message):
        taken.step(inputs_embeds=_chunk(model, 99), position_ids=torch.tensor(positions))
    assert _same_state(taken, twin)
    inside = torch.tensor([[197, 198, 199]])  # explicit positions inside the horizon are taken as given
    assert torch.equal(taken.step(inputs_embeds=_chunk(model, 5), position_ids=inside),
                       twin.step(inputs_embeds=_chunk(model, 5), position_ids=inside))
