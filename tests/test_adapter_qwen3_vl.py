"""Qwen3-VL adapter on a tiny random checkpoint (fp32), against the model's own one-shot forward and generate."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from statekv import FullAttention, StateKV, StreamingPrefill
from statekv.errors import ConfigurationError, InputError, UnsupportedModelError
from statekv.models import load_adapter
from statekv.models.qwen3_vl import Qwen3VLAdapter, QwenVideoSettings
from statekv.testing import make_tiny_checkpoint, write_test_video
from statekv.video import Frame, open_video, temporal_groups

QUESTION = "What happens in the video?"
NEW_TOKENS = 8
FPS = 2.0


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3_vl")


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return Qwen3VLAdapter.from_pretrained(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    """Seven frames (an odd count: four temporal patches, the last one repeating its frame), 96x64."""
    path = write_test_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames=7, fps=FPS, size=(96, 64))
    return list(open_video(path).frames())


@pytest.fixture(autouse=True)
def fresh_rope_deltas(adapter):
    """The model's own forward and generate leave ``rope_deltas`` behind; start every test without it."""
    adapter.model.model.rope_deltas = None
    yield
    adapter.model.model.rope_deltas = None


def stream(adapter, frames, policy=None, **start):
    """Prefix + one chunk per temporal patch (grouped as a pipeline does): (prefill, state, chunks, hidden)."""
    prefill = StreamingPrefill(adapter.model, policy or FullAttention())
    state = adapter.start(len(frames), **start)
    chunks, hidden = [], []
    for group in [None, *temporal_groups(frames, adapter.frames_per_step)]:
        chunk = adapter.prefix(state) if group is None else adapter.frames_chunk(group, state)
        hidden.append(prefill.step(chunk.inputs_embeds, chunk.position_ids, **chunk.forward_kwargs))
        chunks.append(chunk)
        state = state.after(chunk)
    return prefill, state, chunks, torch.cat(hidden, dim=1)


def video_inputs(adapter, ids, frames, state):
    """The model's own inputs for the whole prompt ``ids``: every frame's pixels at once and one video grid."""
    pixel_values, grid_thw = adapter.pixel_values(frames, tuple(state.extra["frame_size"]))
    return dict(input_ids=ids, pixel_values_videos=pixel_values, video_grid_thw=grid_thw,
                mm_token_type_ids=(ids == adapter.video_token_id).long() * 2)


@pytest.fixture(scope="module")
def full_run(adapter, frames):
    prefill, state, chunks, hidden = stream(adapter, frames)
    question = adapter.question_ids(QUESTION, state)
    context = torch.cat([chunk.input_ids for chunk in chunks], dim=1)
    return SimpleNamespace(prefill=prefill, state=state, chunks=chunks, hidden=hidden, question=question,
                           context=context, prompt=torch.cat([context, question], dim=1))


# -- layout ------------------------------------------------------------------------------------------------
def test_prompt_is_the_processors_expansion_of_the_chat_template(adapter, checkpoint, frames, full_run):
    """The streamed ids equal the chat template with the video item expanded by transformers'
    ``Qwen3VLProcessor.replace_video_token`` (its timestamps and placeholders), then tokenized."""
    tokenizer = adapter.tokenizer
    processor = object.__new__(Qwen3VLProcessor)  # its full constructor needs torchvision; the method does not
    processor.video_processor = Qwen3VLVideoProcessor.from_pretrained(checkpoint)
    processor.video_token, processor.vision_start_token, processor.vision_end_token = (
        "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    height, width = full_run.state.extra["frame_size"]
    grid = torch.tensor([[4, height // 16, width // 16]])
    metadata = VideoMetadata(total_num_frames=len(frames), fps=FPS, frames_indices=[f.index for f in frames])
    expanded = processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [metadata]}, 0)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = text.replace("<|video_pad|>", expanded)
    assert "<3.0 seconds>" in text  # the lone last frame's own time
    assert full_run.prompt[0].tolist() == tokenizer(text, add_special_tokens=False).input_ids
    assert [chunk.frames for chunk in full_run.chunks] == [0, 2, 2, 2, 1]
    assert full_run.state.frames == 7 and full_run.state.tokens == full_run.context.shape[1]


def test_a_system_prompt_in_the_template_goes_into_the_prefix(adapter):
    template = "{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' -}}" + adapter.tokenizer.chat_template
    custom = Qwen3VLAdapter(adapter.model, adapter.tokenizer, adapter.settings, chat_template=template)
    assert custom.prefix_text == "<|im_start|>system\nBe brief.<|im_end|>\n" + adapter.prefix_text
    assert custom.question_open + "Q" + custom.question_close == adapter.question_open + "Q" + adapter.question_close


# -- exactness against the model's own one-shot path -------------------------------------------------------
def test_full_attention_streaming_equals_one_shot_forward_and_generate(adapter, frames, full_run):
    model = adapter.model
    inputs = video_inputs(adapter, full_run.context, frames, full_run.state)
    with torch.no_grad():
        reference = model.model(**inputs, use_cache=True)
    torch.testing.assert_close(full_run.hidden, reference.last_hidden_state, atol=1e-4, rtol=0)
    for streamed, one_shot in zip(full_run.prefill.detailed_cache.layers, reference.past_key_values.layers):
        torch.testing.assert_close(streamed.keys, one_shot.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(streamed.values, one_shot.values, atol=1e-4, rtol=0)

    model.model.rope_deltas = None
    expected = model.generate(**video_inputs(adapter, full_run.prompt, frames, full_run.state),
                              max_new_tokens=NEW_TOKENS, do_sample=False)[:, full_run.prompt.shape[1]:]
    model.model.rope_deltas = None  # what generate left for this very video must not be needed
    answer = full_run.prefill.generate(adapter.prompt(full_run.question, full_run.state), max_new_tokens=NEW_TOKENS)
    assert answer.tolist() == expected.tolist()
    assert answer.shape[1] > 1  # decoding ran past the first token, so later M-RoPE steps were exercised


def test_statekv_with_room_for_everything_equals_full_attention(adapter, frames, full_run):
    prefill, state, _, hidden = stream(adapter, frames, StateKV(budget=full_run.state.tokens))
    assert torch.equal(hidden, full_run.hidden)
    answer = prefill.generate(adapter.prompt(full_run.question, state), max_new_tokens=NEW_TOKENS)
    expected = full_run.prefill.generate(adapter.prompt(full_run.question, full_run.state), max_new_tokens=NEW_TOKENS)
    assert answer.tolist() == expected.tolist()


def test_statekv_with_a_small_budget_streams_and_answers(adapter, frames, full_run):
    budget = 8
    prefill, state, chunks, _ = stream(adapter, frames, StateKV(budget=budget))
    assert state.tokens == full_run.state.tokens and state.next_position == full_run.state.next_position
    for layer in range(adapter.model.config.text_config.num_hidden_layers):
        assert prefill.carried_positions(layer).shape[-1] == budget  # full, but never more
    answer = prefill.generate(adapter.prompt(full_run.question, state), max_new_tokens=NEW_TOKENS)
    assert answer.dtype == torch.long and 1 <= answer.shape[1] <= NEW_TOKENS


def test_vision_encoding_per_chunk_equals_encoding_the_video_at_once(adapter, frames, full_run):
    size = tuple(full_run.state.extra["frame_size"])
    at_once, at_once_grid = adapter.pixel_values(frames, size)
    features, deepstack = adapter.video_features(at_once, at_once_grid)
    per_chunk = [adapter.video_features(*adapter.pixel_values(group, size)) for group in temporal_groups(frames)]
    assert at_once_grid[0, 0] == len(per_chunk) == 4
    torch.testing.assert_close(torch.cat([f for f, _ in per_chunk]), features, atol=1e-5, rtol=0)
    assert len(deepstack) == len(adapter.model.config.vision_config.deepstack_visual_indexes)
    for layer, expected in enumerate(deepstack):
        torch.testing.assert_close(torch.cat([d[layer] for _, d in per_chunk]), expected, atol=1e-5, rtol=0)
    # each chunk hands its own DeepStack features and pad mask to the decoder
    for chunk, (_, chunk_deepstack) in zip(full_run.chunks[1:], per_chunk):
        mask = chunk.forward_kwargs["visual_pos_masks"]
        assert torch.equal(mask, chunk.input_ids == adapter.video_token_id)
        for given, expected in zip(chunk.forward_kwargs["deepstack_visual_embeds"], chunk_deepstack):
            assert given.shape == (int(mask.sum()), expected.shape[-1])
            torch.testing.assert_close(given, expected, atol=1e-5, rtol=0)


def test_chunk_positions_concatenated_equal_get_rope_index_of_the_whole_prompt(adapter, frames, full_run):
    inputs = video_inputs(adapter, full_run.prompt, frames, full_run.state)
    expected, deltas = adapter.model.model.get_rope_index(
        full_run.prompt, mm_token_type_ids=inputs["mm_token_type_ids"], video_grid_thw=inputs["video_grid_thw"])
    question = adapter.text_positions(full_run.state, full_run.question.shape[1])
    streamed = torch.cat([chunk.position_ids for chunk in full_run.chunks] + [question], dim=-1)
    assert torch.equal(streamed[1:], expected)
    assert torch.equal(streamed[0, 0], torch.arange(full_run.prompt.shape[1]))
    pads = full_run.prompt[0] == adapter.video_token_id
    assert (expected[0, 0, pads] != expected[2, 0, pads]).any()  # spatial rows really differ from time
    assert full_run.state.next_position - full_run.state.tokens == int(deltas)
    for chunk in full_run.chunks:
        assert chunk.next_position == int(chunk.position_ids[1:].max()) + 1


# -- resolution --------------------------------------------------------------------------------------------
def _frames(sizes, start=0):
    """Frames of the given (height, width) sizes, 0.5 s apart, with random pixels."""
    generator = np.random.default_rng(start)
    return [Frame(start + i, (start + i) / FPS, generator.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for i, (h, w) in enumerate(sizes)]


def _pads(adapter, chunk):
    return int((chunk.input_ids == adapter.video_token_id).sum())


def test_resolution_is_fixed_by_the_first_frame(adapter):
    frames = _frames([(64, 96), (64, 96), (128, 128), (256, 64), (32, 32)])
    _, state, chunks, _ = stream(adapter, frames)
    assert state.extra["frame_size"] == [64, 96]
    assert [_pads(adapter, chunk) for chunk in chunks[1:]] == [6, 6, 6]
    assert all("frame_size" not in chunk.state_update for chunk in chunks[2:])
    assert json.loads(json.dumps(state.to_dict())) == state.to_dict()  # the state stays serialisable


def test_default_resolution_is_the_video_processors_choice_for_the_frame_count(adapter, checkpoint):
    processor = Qwen3VLVideoProcessor.from_pretrained(checkpoint)
    # 5 frames of 128x160: transformers rounds the count to 4 for its budget check and keeps 20 tokens per
    # patch where a per-frame budget of 16 tokens would shrink the frames.
    for count, (height, width) in [(5, (128, 160)), (4, (128, 160)), (3, (512, 384)), (2, (16, 16))]:
        frames = _frames([(height, width)] * count)
        _, state, chunks, _ = stream(adapter, frames)
        patches = processor.get_num_of_video_patches(count, height, width)
        assert sum(_pads(adapter, chunk) for chunk in chunks) == patches // 4, (count, height, width)
    assert _pads(adapter, stream(adapter, _frames([(128, 160)] * 5))[2][1]) == 20


def test_tokens_per_frame_and_open_ended_streams_set_the_per_frame_budget(adapter):
    frames = _frames([(256, 256)] * 2)
    for tokens_per_frame, pads in [(1, 1), (4, 4), (9, 9), (16, 16), (64, 64)]:
        custom = Qwen3VLAdapter(adapter.model, adapter.tokenizer, adapter.settings, tokens_per_frame=tokens_per_frame)
        chunk = custom.frames_chunk(frames, custom.start(2))
        assert _pads(custom, chunk) == pads
        assert custom.max_video_tokens(2) >= custom.prefix(custom.start(2)).num_tokens + chunk.num_tokens
    open_ended = adapter.frames_chunk(frames, adapter.start(None))  # the per-frame cap: 16 tokens
    assert _pads(adapter, open_ended) == adapter.settings.max_frame_tokens == 16


@pytest.mark.parametrize("height, width", [(16, 16), (3000, 4000), (40, 4000), (4000, 20)])
def test_odd_frame_sizes_stream_within_the_planned_tokens(adapter, height, width):
    frames = _frames([(height, width)])
    _, state, chunks, _ = stream(adapter, frames)
    h, w = state.extra["frame_size"]
    assert h % 32 == 0 and w % 32 == 0
    assert _pads(adapter, chunks[1]) >= 1
    exact = adapter.max_video_tokens(1, frame_size=(height, width))
    assert adapter.min_video_tokens(1) <= adapter.min_video_tokens(1, frame_size=(height, width)) <= state.tokens
    assert state.tokens <= exact <= adapter.max_video_tokens(1)
    assert exact - state.tokens == len("<999999.9 seconds>") - chunks[1].num_tokens + _pads(adapter, chunks[1]) + 2
    for tokens_per_frame in (None, 4):
        custom = Qwen3VLAdapter(adapter.model, adapter.tokenizer, adapter.settings, tokens_per_frame=tokens_per_frame)
        for count in (1, 7, 512):
            size = custom.settings.frame_size(height, width, count, tokens_per_frame)
            assert size[0] * size[1] // 32**2 <= custom.settings.max_patch_tokens(count, tokens_per_frame)


def test_preprocessing_equals_the_transformers_video_processor(adapter, checkpoint, frames, tmp_path):
    pytest.importorskip("torchvision", reason="transformers' Qwen3-VL video processor needs torchvision")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    larger = write_test_video(tmp_path / "larger.mp4", frames=7, fps=FPS, size=(256, 192))
    for video in (frames, list(open_video(larger).frames())):  # kept at 96x64; resized from 256x192 to 128x96
        _, state, chunks, _ = stream(adapter, video)
        prompt = torch.cat([chunk.input_ids for chunk in chunks] + [adapter.question_ids(QUESTION, state)], dim=1)
        metadata = VideoMetadata(total_num_frames=len(video), fps=FPS, frames_indices=[f.index for f in video])
        inputs = processor(text=[text], videos=[np.stack([f.image for f in video])], video_metadata=[metadata],
                           do_sample_frames=False, return_tensors="pt")
        pixel_values, grid_thw = adapter.pixel_values(video, tuple(state.extra["frame_size"]))
        assert torch.equal(inputs["video_grid_thw"], grid_thw)
        assert torch.equal(inputs["input_ids"], prompt)
        assert torch.equal(inputs["mm_token_type_ids"].long(), (prompt == adapter.video_token_id).long() * 2)
        # PIL's bicubic (here) and torchvision's antialiased bicubic differ by a grey level or two
        torch.testing.assert_close(pixel_values, inputs["pixel_values_videos"], atol=0.05, rtol=0)
    assert state.extra["frame_size"] == [96, 128]


# -- decoding leaves no trace ------------------------------------------------------------------------------
def test_asking_twice_gives_the_same_answer_and_leaves_model_and_cache_as_found(adapter, frames, full_run):
    before = [(layer.keys.clone(), layer.values.clone()) for layer in full_run.prefill.detailed_cache.layers]
    sticky = torch.tensor([[12345]])
    adapter.model.model.rope_deltas = sticky
    first = full_run.prefill.generate(adapter.prompt(full_run.question, full_run.state), max_new_tokens=NEW_TOKENS)
    assert adapter.model.model.rope_deltas is sticky
    # the model's own generate on another prompt leaves other rope_deltas behind: no effect on the answer
    one_patch = torch.cat([chunk.input_ids for chunk in full_run.chunks[:2]], dim=1)
    adapter.model.generate(**video_inputs(adapter, one_patch, frames[:2], full_run.state), max_new_tokens=2)
    assert adapter.model.model.rope_deltas is not sticky
    second = full_run.prefill.generate(adapter.prompt(full_run.question, full_run.state), max_new_tokens=NEW_TOKENS)
    assert first.tolist() == second.tolist()
    assert full_run.prefill.seen_tokens == full_run.state.tokens
    for (keys, values), layer in zip(before, full_run.prefill.detailed_cache.layers):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)


# -- loading and errors ------------------------------------------------------------------------------------
def test_load_adapter_picks_this_adapter_and_reads_the_video_config(checkpoint):
    loaded = load_adapter(checkpoint, dtype=torch.float32, tokens_per_frame=4)
    assert isinstance(loaded, Qwen3VLAdapter) and loaded.tokens_per_frame == 4
    assert not loaded.model.training and loaded.dtype == torch.float32
    assert loaded.settings == QwenVideoSettings(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=(0.5,) * 3, image_std=(0.5,) * 3,
        min_pixels=64 * 64, max_pixels=16 * 32 * 32 * 64, max_frame_tokens=16, cap_pixels_per_frame=True)
    assert loaded.video_token_id == loaded.tokenizer.convert_tokens_to_ids("<|video_pad|>")


def test_video_config_falls_back_to_the_preprocessor_config(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14, "size": {
        "shortest_edge": 100, "longest_edge": 1000}, "image_mean": [0.1, 0.2, 0.3]}))
    settings = QwenVideoSettings.from_pretrained(tmp_path)
    assert (settings.patch_size, settings.min_pixels, settings.max_pixels) == (14, 100, 1000)
    assert settings.image_mean == (0.1, 0.2, 0.3) and settings.merge_size == Qwen3VLVideoProcessor.merge_size


@pytest.mark.parametrize("field, value", [("merge_size", 1), ("patch_size", 14)])
def test_a_video_config_that_disagrees_with_the_vision_tower_is_refused(adapter, tmp_path, field, value):
    """Patches laid out for another patch or merge size would reach the tower in an order it does not read."""
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({field: value}))
    settings = QwenVideoSettings.from_pretrained(tmp_path)
    with pytest.raises(InputError, match=f"says {field} {value}, but the vision tower") as error:
        Qwen3VLAdapter(adapter.model, adapter.tokenizer, settings)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("config", [{"patch_size": None}, {"patch_size": 0}, {"image_mean": 0.5},
                                    {"size": {"shortest_edge": 10, "longest_edge": "lots"}}, ["not", "a", "dict"]])
def test_a_malformed_video_config_is_refused_in_one_line(tmp_path, config):
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="video preprocessing config is malformed") as error:
        QwenVideoSettings.from_pretrained(tmp_path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("dropped", ["text_config", "vision_config"])
def test_a_config_without_its_text_or_vision_sizes_is_refused_before_any_model_is_built(checkpoint, tmp_path,
                                                                                       dropped, monkeypatch):
    """Before: transformers built its default sizes (an 8B language model, tens of GiB in float32) for the missing
    part, and only then found the weights unlike it."""
    import transformers

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    del config[dropped]
    (copy / "config.json").write_text(json.dumps(config))
    built = []
    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", lambda *args, **kwargs: built.append(1))
    with pytest.raises(InputError, match=f"its config.json has no {dropped}") as error:
        Qwen3VLAdapter.from_pretrained(copy)
    assert "\n" not in str(error.value) and not built


def test_bad_inputs_raise_one_line_errors(adapter, frames, full_run, tmp_path):
    state = adapter.start(7)
    cases = [
        (InputError, lambda: adapter.frames_chunk(frames[:3], state)),
        (InputError, lambda: adapter.frames_chunk([frames[0].image], state)),
        (InputError, lambda: adapter.frames_chunk(_frames([(8, 2000)]), state)),  # aspect ratio over 200
        (InputError, lambda: adapter.start(0)),
        (InputError, lambda: adapter.max_video_tokens(-1)),
        (InputError, lambda: adapter.question_ids("  ", state)),
        (InputError, lambda: full_run.prefill.generate(adapter.prompt(full_run.question, state))),
        (ConfigurationError, lambda: Qwen3VLAdapter(adapter.model, adapter.tokenizer, adapter.settings,
                                                    tokens_per_frame=0)),
    ]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "internvl"}))
    cases.append((UnsupportedModelError, lambda: Qwen3VLAdapter.from_pretrained(tmp_path)))
    for error, call in cases:
        with pytest.raises(error) as raised:
            call()
        assert "\n" not in str(raised.value)


def test_a_stream_with_no_horizon_saved_with_its_first_frame_waiting_loads(adapter, frames, tmp_path):
    """Qwen3-VL steps two frames at a time, so a stream's first frame waits for its second. Before: a stream with no
    horizon saved then was refused when loaded (``num_frames must be a positive integer, got 0``)."""
    from statekv import Stream, VideoQA

    qa = VideoQA(adapter, StateKV(budget=64), attention="eager")
    live = qa.stream()
    live.push(frames[0])
    assert live.frames == 0 and len(live.pending) == 1
    with Stream.load(live.save(tmp_path / "waiting.safetensors"), qa) as back:
        back.push(frames[1])
        live.push(frames[1])
        assert back.frames == live.frames == 2
        assert torch.equal(back.ask_tokens(QUESTION, max_new_tokens=2), live.ask_tokens(QUESTION, max_new_tokens=2))
    live.close()


# -- exactness over configurations real checkpoints have ---------------------------------------------------
VARIANTS = {
    "one-kv-head": dict(text_config={"num_key_value_heads": 1}),
    "kv-heads-equal-heads": dict(text_config={"num_key_value_heads": 4}),
    "head-dim-unlike-hidden-over-heads": dict(text_config={"head_dim": 32}),
    "untied": dict(tie_word_embeddings=False, text_config={"tie_word_embeddings": False}),
    "mrope-not-interleaved": dict(text_config={"rope_parameters": {
        "rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2], "mrope_interleaved": False}}),
    "patch-14-no-merge": dict(vision_config={"patch_size": 14, "spatial_merge_size": 1}),
    "eager": dict(attn_implementation="eager"),
    "bfloat16": dict(dtype=torch.bfloat16),
}


@pytest.mark.parametrize("variant, count", [*((name, 7) for name in VARIANTS), ("frames", 1), ("frames", 3),
                                            ("frames", 5)])
def test_streaming_equals_one_shot_generate_across_configurations(tmp_path, variant, count):
    """Full attention and StateKV with room for every token answer as the model's own one-shot generate."""
    overrides = dict(VARIANTS.get(variant, {}))
    attention = overrides.pop("attn_implementation", None)
    path = make_tiny_checkpoint("qwen3_vl", tmp_path / "ckpt", **overrides)
    loaded = load_adapter(path, **({"attn_implementation": attention} if attention else {}))
    assert loaded.dtype == overrides.get("dtype", torch.float32)
    video = write_test_video(tmp_path / "clip.mp4", frames=count, fps=FPS, size=(96, 64))
    clip = list(open_video(video).frames())
    full, state, chunks, _ = stream(loaded, clip)
    question = loaded.question_ids(QUESTION, state)
    prompt = torch.cat([chunk.input_ids for chunk in chunks] + [question], dim=1)
    inputs = video_inputs(loaded, prompt, clip, state)
    inputs["pixel_values_videos"] = inputs["pixel_values_videos"].to(loaded.dtype)
    expected = loaded.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[:, prompt.shape[1]:]
    roomy, roomy_state, _, _ = stream(loaded, clip, StateKV(budget=state.tokens))
    for prefill, at in ((full, state), (roomy, roomy_state)):
        loaded.model.model.rope_deltas = None
        assert prefill.generate(loaded.prompt(question, at), max_new_tokens=NEW_TOKENS).tolist() == expected.tolist()
