"""`StreamingPrefill.probing`: what each step's layers attend over, shown as the step runs."""

from __future__ import annotations

import pytest
import torch

import statekv
from conftest import CHUNK_LENGTHS, random_frames, split
from test_streaming import one_shot, tokens


def test_a_probe_sees_the_model_s_own_keys_and_values_and_changes_nothing(tiny_lm):
    """Full attention inside the range: at every step and layer the probe is shown the chunk's queries and the keys
    and values of every token up to the step's end, the model's own one-shot forward's; the stream's output is
    the unprobed stream's; a second probe is refused, and the probe is gone after its block, even when it fails."""
    model = tiny_lm("qwen2")
    ids = tokens(model)
    _, reference = one_shot(model, ids)
    plain = statekv.StreamingPrefill(model, statekv.FullAttention())
    expected = torch.cat([plain.step(input_ids=chunk) for chunk in split(ids)], 1)
    prefill = statekv.StreamingPrefill(model, statekv.FullAttention())
    seen = []

    def record(step, layer, queries, keys, values):
        seen.append((step, layer, queries.shape[2], keys.clone(), values.clone()))

    with prefill.probing(record):
        hidden = torch.cat([prefill.step(input_ids=chunk) for chunk in split(ids)], 1)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)
    layers = model.config.num_hidden_layers
    assert [entry[:2] for entry in seen] == [(step, layer) for step in range(len(CHUNK_LENGTHS))
                                             for layer in range(layers)]
    end = 0
    for step, length in enumerate(CHUNK_LENGTHS):
        end += length
        for layer in range(layers):
            _, _, queries, keys, values = seen[step * layers + layer]
            assert queries == length
            torch.testing.assert_close(keys, reference.layers[layer].keys[:, :, :end], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(values, reference.layers[layer].values[:, :, :end], rtol=1e-5, atol=1e-5)
    with prefill.probing(record):
        with pytest.raises(statekv.ConfigurationError, match="already probed"), prefill.probing(lambda *args: None):
            pass
        seen.clear()
        prefill.step(input_ids=ids[:, :3])
        assert seen  # the refused probe left the first one installed
    with pytest.raises(RuntimeError, match="inside"), prefill.probing(record):
        raise RuntimeError("inside")
    seen.clear()
    prefill.step(input_ids=ids[:, :3])
    assert not seen


def test_a_probed_stream_pushed_with_others_steps_alone_and_is_shown_every_step():
    """Steady streams pushed together share one batched (or pooled) step; a probed one is taken out of it, so its
    probe sees every layer of every step, and it carries what the same stream pushed alone carries."""
    qa = statekv.VideoQA.from_pretrained("builtin", method="statekv", budget=8)
    frames = random_frames(24, height=28, width=28)
    alone, probed, other = (qa.stream(max_fps=1) for _ in range(3))
    for k, frame in enumerate(frames):
        alone.push(frame, float(k))
    alone.flush()
    layers, begun = [], probed.prefill.cache.step_starts().numel() - 1  # the prompt's prefix, stepped at the start
    with probed.prefill.probing(lambda step, layer, *tensors: layers.append((step, layer))):
        for k, frame in enumerate(frames):
            qa.push_many([(probed, frame, float(k)), (other, frame, float(k))])
    steps = probed.prefill.cache.step_starts().numel() - 1 - begun
    depth = qa.adapter.model.config.text_config.num_hidden_layers
    assert begun == 1 and steps == len(frames)
    assert layers == [(begun + step, layer) for step in range(steps) for layer in range(depth)]
    for layer in range(depth):  # the vision tower's batch of frames may round differently: the selection is equal
        assert torch.equal(probed.prefill.carried_positions(layer), alone.prefill.carried_positions(layer))
    for mine, theirs in zip(probed.prefill.state_dict()[0].values(), alone.prefill.state_dict()[0].values()):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    for stream in (alone, probed, other):
        stream.close()
