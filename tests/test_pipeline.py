"""VideoQA end to end on a tiny InternVL checkpoint loaded through from_pretrained, and its error paths.

The one-shot references build the prompt independently of the adapter: the paper's layout by hand, the chat
layout as transformers' InternVL processor writes it (``Frame{i}: <img>…</img>`` lines joined by newlines in
place of the template's ``<video>``). Sequences stay inside the tiny LM's 128 trained positions, so the
one-shot model's dynamic RoPE never rescales and the comparison is exact.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import statekv
from bad_videos import BAD_VIDEOS
from statekv.models import InternVLAdapter, load_adapter
from statekv.testing import make_tiny_checkpoint, write_test_video
from statekv.video import VideoError, internvl_pixel_values, open_video

from conftest import tiny_qa

QUESTION = "Why?"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(checkpoint):
    return {layout: load_adapter(checkpoint, layout=layout) for layout in InternVLAdapter.layouts}


def _video(frames: int, seed: int = 0, size: tuple[int, int] = (40, 60)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, *size, 3), dtype=np.uint8)


def _one_shot_answer(adapter, source, question: str) -> torch.Tensor:
    """The model's own generate over the whole prompt and every sampled frame at once; new tokens [1, N]."""
    tokenizer, model = adapter.tokenizer, adapter.model
    video = [frame.image for frame in open_video(source).sample()]
    block = "<img>" + "<IMG_CONTEXT>" * model.config.image_seq_length + "</img>"
    turn = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    if adapter.layout == "paper":
        text_turn = [{"role": "user", "content": [{"type": "text", "text": question}]}]
        prompt = f"{block}\n" * len(video) + tokenizer.apply_chat_template(
            text_turn, tokenize=False, add_generation_prompt=True)
    else:
        frames = "\n".join(f"Frame{i + 1}: {block}" for i in range(len(video)))
        prompt = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        prompt = prompt.replace("<video>", frames)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    assert ids.shape[1] + NEW_TOKENS <= model.config.text_config.max_position_embeddings
    pixels = torch.stack([internvl_pixel_values(frame, adapter.image_size) for frame in video]).to(model.dtype)
    output = model.generate(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                            max_new_tokens=NEW_TOKENS, do_sample=False)
    return output[:, ids.shape[1]:]


# ---------------------------------------------------------------------------------------------------
# Exactness
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", InternVLAdapter.layouts)
def test_streaming_answers_token_identical_to_one_shot_generate(adapters, layout):
    adapter = adapters[layout]
    video = open_video(_video(6), fps=2)  # sampled at 1 fps: frames 0, 2, 4
    expected = _one_shot_answer(adapter, video, QUESTION)
    for method, policy in (("full", {}), ("statekv", {"budget": 10_000})):
        encoded = tiny_qa(adapter, statekv.make_policy(method, **policy)).encode(video)
        assert encoded.frames == 3
        assert torch.equal(encoded.ask_tokens(QUESTION, max_new_tokens=NEW_TOKENS), expected), method


def test_paper_layout_is_259_tokens_per_frame_at_full_size(adapters):
    adapter = adapters["paper"]
    per_frame = adapter.tokenize(adapter.frame_text(0, 0.0)).shape[1]
    assert per_frame == adapter.tokens_per_image + 3  # <img> + visual tokens + </img> + \n (256 + 3 = 259)
    assert adapter.max_video_tokens(5) == 5 * per_frame and adapter.prefix(adapter.start(5)) is None


def test_per_frame_vision_encoding_equals_all_at_once(adapters):
    adapter = adapters["paper"]
    pixels = torch.stack([internvl_pixel_values(frame, adapter.image_size) for frame in _video(3)])
    together = adapter.visual_features(pixels)
    one_by_one = torch.cat([adapter.visual_features(pixels[i: i + 1]) for i in range(3)])
    torch.testing.assert_close(one_by_one, together, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Encode once, ask many
# ---------------------------------------------------------------------------------------------------


def _snapshot(encoded: statekv.EncodedVideo) -> list[torch.Tensor]:
    cache = encoded.prefill.detailed_cache
    tensors = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]
    layers = range(len(encoded.prefill.cache.layers))
    return tensors + [encoded.prefill.carried_positions(i).clone() for i in layers]


def test_asking_twice_gives_the_same_answer_and_leaves_the_encoding_unchanged(adapters):
    encoded = tiny_qa(adapters["paper"], statekv.StateKV(budget=10)).encode(_video(4))
    before, state = _snapshot(encoded), encoded.state
    first = encoded.ask_tokens(QUESTION, max_new_tokens=NEW_TOKENS)
    second = encoded.ask_tokens(QUESTION, max_new_tokens=NEW_TOKENS)
    assert torch.equal(first, second) and first.shape == (1, NEW_TOKENS)
    after = _snapshot(encoded)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and encoded.state == state
    assert isinstance(encoded.ask(QUESTION, max_new_tokens=3), str)


def test_answer_encodes_once_and_answers_every_question(adapters, monkeypatch):
    qa = tiny_qa(adapters["chat"], statekv.Recency(frames=1))
    encodings = []
    encode = qa.encode
    monkeypatch.setattr(qa, "encode", lambda *a, **k: encodings.append(1) or encode(*a, **k))
    video = _video(2)
    answers = qa.answer(video, ["Why?", "Who?"], max_new_tokens=4)
    assert len(encodings) == 1 and len(answers) == 2
    with encode(video) as encoded:
        assert answers == [encoded.ask("Why?", max_new_tokens=4), encoded.ask("Who?", max_new_tokens=4)]
    assert qa.answer(video, "Why?", max_new_tokens=4) == answers[0]


def test_stats_describe_the_encoding(adapters):
    budget = 12
    seen = []
    encoded = tiny_qa(adapters["paper"], statekv.StateKV(budget=budget)).encode(
        _video(10), max_fps=1, max_frames=5, progress=lambda done, planned: seen.append((done, planned)))
    stats = encoded.stats
    assert (stats.frames, stats.chunks, stats.tokens) == (5, 5, 5 * 19) == (encoded.frames, 5, encoded.tokens)
    assert stats.carried_tokens == budget and len(stats.frame_seconds) == 5
    assert all(s > 0 for s in stats.frame_seconds) and stats.seconds == pytest.approx(sum(stats.frame_seconds))
    assert stats.cache_bytes >= 3 * 2 * 2 * 95 * 16 * 4  # layers x (K, V) x KV heads x tokens x head dim x fp32
    assert stats.peak_memory_bytes is None  # CPU
    assert seen == [(i, 5) for i in range(1, 6)]
    assert set(stats.to_dict()) >= {"frames", "tokens", "carried_tokens", "frame_seconds", "peak_memory_bytes"}


def test_recency_window_is_given_in_frames():
    assert statekv.make_policy("recency", frames=16).frames == 16
    assert statekv.make_policy("recency", frames=3, frames_per_step=2).frames == 2


def test_from_pretrained_loads_the_family_and_method(checkpoint):
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=64, layout="chat", dtype="float32",
                                         device="cpu")
    assert isinstance(qa.adapter, InternVLAdapter) and qa.adapter.layout == "chat"
    assert qa.policy == statekv.StateKV(budget=64) and qa.adapter.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# Unusual but valid inputs
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [(16, 16), (3000, 4000), (16, 200), (333, 17)], ids=str)
def test_frame_sizes_and_aspect_ratios(adapters, size):
    encoded = tiny_qa(adapters["paper"], "full").encode(_video(1, size=size))
    assert encoded.frames == 1 and encoded.tokens == 19
    assert 1 <= encoded.ask_tokens(QUESTION, max_new_tokens=2).shape[1] <= 2  # may stop early at <|im_end|>


def test_variable_frame_rate_file_and_image_folder(adapters, tmp_path):
    qa = tiny_qa(adapters["chat"], statekv.StateKV(budget=8))
    clip = write_test_video(tmp_path / "vfr.mp4", frames=12, fps=4, vfr=True)
    planned = open_video(clip).sample_indices(max_fps=1)
    assert qa.encode(clip, max_fps=1).frames == len(planned) >= 2
    folder = tmp_path / "frames"
    folder.mkdir()
    from PIL import Image

    for i, frame in enumerate(_video(3)):
        Image.fromarray(frame).save(folder / f"frame_{i}.png")
    assert qa.encode(folder).frames == 3


# ---------------------------------------------------------------------------------------------------
# Bad input: one clear line each, before any work
# ---------------------------------------------------------------------------------------------------


def _one_line(error: BaseException) -> str:
    message = str(error)
    assert message and "\n" not in message
    return message


@pytest.mark.parametrize("name", BAD_VIDEOS)
def test_bad_videos(adapters, tmp_path, name):
    make, phrase = BAD_VIDEOS[name]
    with pytest.raises(VideoError) as info:
        tiny_qa(adapters["paper"], "full").encode(make(tmp_path))
    assert phrase in _one_line(info.value)


def test_bad_settings(checkpoint, adapters):
    for budget in (0, -5):
        with pytest.raises(statekv.ConfigurationError, match="budget") as info:
            statekv.VideoQA.from_pretrained(checkpoint, budget=budget)
        _one_line(info.value)
    with pytest.raises(statekv.ConfigurationError, match="window"):
        statekv.VideoQA.from_pretrained(checkpoint, method="recency", frames=0)
    with pytest.raises(statekv.ConfigurationError, match="full, recency|statekv, full"):
        statekv.VideoQA.from_pretrained(checkpoint, method="sliding")
    with pytest.raises(statekv.InputError, match="layout 'card'"):
        statekv.VideoQA.from_pretrained(checkpoint, layout="card")
    qa = tiny_qa(adapters["paper"], "full")
    with pytest.raises(statekv.InputError, match="max_frames"):
        qa.encode(_video(2), max_frames=0)
    with pytest.raises(statekv.InputError, match="max_fps"):
        qa.encode(_video(2), max_fps=-1)


def test_empty_question(adapters):
    encoded = tiny_qa(adapters["paper"], "full").encode(_video(1))
    for question in ("", "   \n"):
        with pytest.raises(statekv.InputError, match="question is empty"):
            encoded.ask(question)
    with pytest.raises(statekv.InputError, match="question is empty"):
        tiny_qa(adapters["paper"], "full").answer(_video(1), "")


def test_question_and_answer_must_fit_the_reserve(adapters):
    encoded = tiny_qa(adapters["paper"], "full", reserve_tokens=20).encode(_video(1))
    with pytest.raises(statekv.HorizonError, match="reserve_tokens") as info:
        encoded.ask(QUESTION, max_new_tokens=8)
    _one_line(info.value)


def test_horizon_beyond_the_models_rope_fails_before_any_frame_with_stream_positions(tmp_path, monkeypatch):
    """positions="stream" beyond the RoPE fails before any frame; by default such a video is encoded with bounded
    positions, and a question reads what fits the range."""
    static_rope = {"max_position_embeddings": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "short", text_config=static_rope)
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="full", reserve_tokens=16, positions="stream")
    encoded_frames = []
    original = qa.adapter.prepare_frames
    monkeypatch.setattr(qa.adapter, "prepare_frames", lambda *args: encoded_frames.append(args))
    with pytest.raises(statekv.HorizonError, match="beyond the model's RoPE") as info:
        qa.encode(_video(8), max_frames=8)
    _one_line(info.value)
    assert not encoded_frames
    monkeypatch.setattr(qa.adapter, "prepare_frames", original)
    video = qa.with_options(positions=None).encode(_video(8), max_frames=8)
    assert video.prefill.positions.mode == "bounded" and video.tokens > 64
    video.ask("Why?", max_new_tokens=3)
    assert video.answer_info.context == "retrieved"


def test_unsupported_or_missing_model(tmp_path):
    plain = tmp_path / "plain_lm"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(plain)
    with pytest.raises(statekv.UnsupportedModelError) as info:
        statekv.VideoQA.from_pretrained(plain)
    message = _one_line(info.value)
    assert "'qwen2' is not supported" in message and "internvl" in message
    with pytest.raises(statekv.InputError, match="no such checkpoint folder"):
        statekv.VideoQA.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(statekv.InputError, match="no config.json"):
        statekv.VideoQA.from_pretrained(tmp_path)


def _broken_copy(checkpoint, tmp_path, edit):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    edit(broken)
    return broken


def _edit_config(change):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        change(config)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def _remove_tokenizer(folder):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()


@pytest.mark.parametrize("edit, expected", [
    (_remove_tokenizer, "no tokenizer files"),
    (_edit_config(lambda config: config["text_config"].update(num_hidden_layers="three")),
     "config.json is malformed: Validation error for field 'num_hidden_layers'"),
    (_edit_config(lambda config: config["text_config"].update(num_key_value_heads=1)),
     "its weights do not have the shapes its config.json describes"),
], ids=["no-tokenizer", "malformed-field", "weights-unlike-config"])
def test_a_broken_checkpoint_is_refused_in_one_line(checkpoint, tmp_path, edit, expected):
    broken = _broken_copy(checkpoint, tmp_path, edit)
    with pytest.raises(statekv.InputError) as info:
        statekv.VideoQA.from_pretrained(broken)
    assert expected in _one_line(info.value)


def test_a_hub_checkpoint_out_of_reach_is_not_called_one_without_a_tokenizer(checkpoint, tmp_path):
    """Before: offline, a hub id whose config alone was cached was refused as having "no tokenizer files"."""
    snapshot = tmp_path / "hub" / "models--someorg--tinyvl" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(Path(checkpoint) / "config.json", snapshot / "config.json")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    code = ("import statekv.models as m\ntry: m.load_adapter('someorg/tinyvl')\n"
            "except Exception as e: print(type(e).__name__, e)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.stdout.startswith("InputError cannot load someorg/tinyvl"), result.stdout[-500:]
    assert "no tokenizer files" not in result.stdout


def test_a_checkpoint_with_sizes_as_lists_streams_as_its_one_shot_generate(tmp_path):
    """Real InternVL3 ``-hf`` configs give the tower's image and patch sizes as [height, width] lists."""
    path = make_tiny_checkpoint("internvl", tmp_path / "lists", vision_config={"image_size": [112, 112],
                                                                                "patch_size": [14, 14]})
    adapter = load_adapter(path)
    assert adapter.image_size == 112 and adapter.tokens_per_image == 16
    video = open_video(_video(4), fps=2)
    encoded = tiny_qa(adapter, statekv.make_policy("statekv", budget=10_000)).encode(video)
    assert torch.equal(encoded.ask_tokens(QUESTION, max_new_tokens=NEW_TOKENS),
                       _one_shot_answer(adapter, video, QUESTION))


INTERNVL_VARIANTS = {
    "one-kv-head": dict(text_config={"num_key_value_heads": 1}),
    "kv-heads-equal-heads": dict(text_config={"num_key_value_heads": 4}),
    "head-dim-unlike-hidden-over-heads": dict(text_config={"head_dim": 32}),
    "tied": dict(tie_word_embeddings=True, text_config={"tie_word_embeddings": True}),
    "qwen3-language-model": dict(text_config={"model_type": "qwen3", "head_dim": 32}),
    "yarn": dict(text_config={"max_position_embeddings": 256, "rope_parameters": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128, "rope_theta": 1e6}}),
    "bfloat16": dict(dtype=torch.bfloat16),
    "float16": dict(dtype=torch.float16),
}


@pytest.mark.parametrize("variant", INTERNVL_VARIANTS)
@pytest.mark.parametrize("layout", InternVLAdapter.layouts)
def test_streaming_equals_one_shot_generate_across_configurations(tmp_path, variant, layout):
    overrides = INTERNVL_VARIANTS[variant]
    adapter = load_adapter(make_tiny_checkpoint("internvl", tmp_path / "ckpt", **overrides), layout=layout)
    assert adapter.dtype == overrides.get("dtype", torch.float32)
    video = open_video(_video(6), fps=2)
    # in half precision chunked and one-shot sums round apart, so near-tied greedy steps may part late
    compared = NEW_TOKENS if adapter.dtype == torch.float32 else 4
    expected = _one_shot_answer(adapter, video, QUESTION)[:, :compared]
    for method, policy in (("full", {}), ("statekv", {"budget": 10_000})):
        encoded = tiny_qa(adapter, statekv.make_policy(method, **policy)).encode(video)
        assert torch.equal(encoded.ask_tokens(QUESTION, max_new_tokens=NEW_TOKENS)[:, :compared], expected), method
