"""RemoteInternVLAdapter on the tiny remote-code Eagle stand-in, loaded through trust_remote_code (fp32).

References are the model's own one-shot calls (``generate`` / ``forward`` on the whole prompt with all frames'
pixels, ``extract_feature`` on all frames at once); the eagle layout's text is checked against literal strings.
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch

import statekv
import statekv.models.remote_internvl  # noqa: F401  (registers the adapter)
from statekv import InputError, UnsupportedModelError
from statekv.models import adapter_for, load_adapter
from statekv.models.remote_internvl import RemoteInternVLAdapter
from statekv.testing import draw_test_frame
from statekv.video import Frame, internvl_pixel_values

LAYOUTS = ("eagle", "paper", "chat")
TIMESTAMPS = (0.0, 0.5, 1.25, 10.0)
FPS = 2.0
QUESTION = "What is shown?"
NEW_TOKENS = 8
CONTEXT = "<IMG_CONTEXT>" * 16  # 112x112 frame, patch 14, pixel shuffle 0.5


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("eagle")


@pytest.fixture(scope="module")
def adapters(checkpoint):
    return {layout: load_adapter(checkpoint, layout=layout, trust_remote_code=True, dtype=torch.float32)
            for layout in LAYOUTS}


@pytest.fixture(scope="module")
def frames():
    # Not square and not 112x112: the adapter resizes as the real preprocessing does.
    return [Frame(i, t, draw_test_frame(i, (64, 48))) for i, t in enumerate(TIMESTAMPS)]


def _stream(adapter, frames, policy, fps=FPS):
    """Stream ``frames``; returns (prefill, state, [chunk input_ids])."""
    prefill = statekv.StreamingPrefill(adapter.model, policy, attention="eager")
    state = adapter.start(len(frames), fps)
    chunks = [adapter.prefix(state)] if adapter.prefix(state) is not None else []
    for chunk in chunks:
        prefill.step(chunk.inputs_embeds, chunk.position_ids)
        state = state.after(chunk)
    for frame in frames:
        chunk = adapter.frames_chunk([frame], state)
        prefill.step(chunk.inputs_embeds, chunk.position_ids)
        state = state.after(chunk)
        chunks.append(chunk)
    return prefill, state, [chunk.input_ids for chunk in chunks]


def _pixels(adapter, frames):
    return torch.stack([internvl_pixel_values(frame.image, adapter.image_size, mean=adapter.image_mean,
                                              std=adapter.image_std) for frame in frames])


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def test_registered_for_the_remote_model_types():
    for model_type in ("eagle_2_5_vl", "internvl_chat"):
        assert adapter_for(model_type) is RemoteInternVLAdapter
    assert RemoteInternVLAdapter.default_layout("eagle_2_5_vl") == "eagle"
    assert RemoteInternVLAdapter.default_layout("internvl_chat") == "paper"


def test_loading_reads_the_checkpoint(checkpoint):
    adapter = load_adapter(checkpoint, trust_remote_code=True)
    assert isinstance(adapter, RemoteInternVLAdapter) and adapter.layout == "eagle"  # the Eagle default
    assert adapter.image_size == 112 and adapter.tokens_per_image == 16
    assert adapter.image_mean == (0.5, 0.5, 0.5) and adapter.image_std == (0.5, 0.5, 0.5)
    assert adapter.image_token_id == adapter.tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert adapter.model.img_context_token_id == adapter.image_token_id


@pytest.mark.parametrize("call", ["load_adapter", "from_pretrained"])
def test_refused_without_trust_remote_code(checkpoint, call):
    load = load_adapter if call == "load_adapter" else RemoteInternVLAdapter.from_pretrained
    with pytest.raises(UnsupportedModelError) as error:
        load(checkpoint)
    assert "trust_remote_code" in str(error.value) and "\n" not in str(error.value)


def test_context_token_id_is_set_from_the_tokenizer_like_chat(adapters):
    """The remote InternVL leaves img_context_token_id None until chat() sets it; its generate() needs it."""
    adapter = adapters["paper"]
    adapter.model.img_context_token_id = None
    rebuilt = RemoteInternVLAdapter(adapter.model, adapter.tokenizer, layout="paper", image_size=112)
    assert adapter.model.img_context_token_id == rebuilt.image_token_id == 261


def test_a_checkpoint_without_chat_template_is_refused(checkpoint, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    (bare / "chat_template.jinja").unlink()
    with pytest.raises(InputError, match="no chat template"):
        load_adapter(bare, trust_remote_code=True)


def test_bad_layout_and_frame_count(checkpoint, adapters):
    with pytest.raises(InputError, match="no prompt layout"):
        load_adapter(checkpoint, layout="qwen", trust_remote_code=True)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InputError):
            adapters["eagle"].start(bad)
    with pytest.raises(InputError, match="fps"):
        adapters["eagle"].start(4, fps=0)


# ---------------------------------------------------------------------------------------------------
# Streaming equals the model's own one-shot calls
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_streaming_equals_one_shot_generate(adapters, frames, layout):
    adapter = adapters[layout]
    greedy = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    reference = None
    for policy in (statekv.FullAttention(), statekv.StateKV(budget=4096)):
        prefill, state, ids = _stream(adapter, frames, policy)
        assert prefill.decoder is adapter.model.language_model.model
        question = adapter.question_ids(QUESTION, state)
        new = prefill.generate(adapter.prompt(question, state), **greedy)
        if reference is None:
            prompt = torch.cat(ids + [question], dim=1)
            assert prompt.shape[1] < 1024  # well inside the tiny LM's RoPE
            assert adapter.min_video_tokens(len(frames)) <= state.tokens <= adapter.max_video_tokens(len(frames))
            reference = adapter.model.generate(input_ids=prompt, pixel_values=_pixels(adapter, frames),
                                               attention_mask=torch.ones_like(prompt), **greedy)
        assert new.shape == (1, NEW_TOKENS)
        assert torch.equal(new, reference), (policy, new, reference)
    assert adapter.model.vision_model.config._attn_implementation == "sdpa"  # the vision tower was never switched


@pytest.mark.parametrize("layout", ["eagle", "chat"])
def test_detailed_cache_equals_one_shot_forward(adapters, frames, layout):
    adapter = adapters[layout]
    prefill, _, ids = _stream(adapter, frames, statekv.FullAttention())
    video = torch.cat(ids, dim=1)
    with torch.no_grad():
        output = adapter.model(input_ids=video, pixel_values=_pixels(adapter, frames), use_cache=True)
    streamed, one_shot = prefill.detailed_cache, output.past_key_values
    for layer in range(adapter.model.config.text_config.num_hidden_layers):
        torch.testing.assert_close(streamed.layers[layer].keys, one_shot.layers[layer].keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(streamed.layers[layer].values, one_shot.layers[layer].values, atol=1e-4, rtol=0)


def test_per_frame_vision_equals_all_at_once(adapters, frames):
    adapter = adapters["eagle"]
    with torch.no_grad():
        together = adapter.model.extract_feature(_pixels(adapter, frames))  # [4, 16, 64]
    state = adapter.start(len(frames), FPS)
    state = state.after(adapter.prefix(state))
    for index, frame in enumerate(frames):
        chunk = adapter.frames_chunk([frame], state)
        slots = chunk.input_ids[0] == adapter.image_token_id
        assert int(slots.sum()) == 16
        torch.testing.assert_close(chunk.inputs_embeds[0, slots], together[index], atol=1e-5, rtol=1e-5)
        state = state.after(chunk)


def test_asking_twice_gives_the_same_answer_and_keeps_the_cache(adapters, frames):
    adapter = adapters["eagle"]
    prefill, state, _ = _stream(adapter, frames, statekv.StateKV(budget=48))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in prefill.detailed_cache.layers]
    question = adapter.question_ids(QUESTION, state)
    first = prefill.generate(adapter.prompt(question, state), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    other = prefill.generate(adapter.prompt(adapter.question_ids("Why?", state), state), max_new_tokens=3)
    second = prefill.generate(adapter.prompt(question, state), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert torch.equal(first, second) and other.shape[1] >= 1
    assert prefill.seen_tokens == state.tokens
    for (keys, values), layer in zip(before, prefill.detailed_cache.layers):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
    with pytest.raises(InputError, match="layout state"):
        prefill.generate(adapter.prompt(question, adapter.start(4)), max_new_tokens=1)


# ---------------------------------------------------------------------------------------------------
# The eagle layout's text
# ---------------------------------------------------------------------------------------------------


def _eagle_prompt(opening: str) -> str:
    frames = "".join(f"Frame {i} sample at {t}s: <img>{CONTEXT}</img>"
                     for i, t in ((1, "0.00"), (2, "0.50"), (3, "1.25"), (4, "10.00")))
    return f"<|im_start|>user\n{opening}: {frames}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("fps, opening", [(FPS, "The first video sampled with 2.00 fps"),
                                          (0.5, "The first video sampled with 0.50 fps"),
                                          (None, "The first video")])
def test_eagle_layout_text(adapters, frames, fps, opening):
    adapter = adapters["eagle"]
    _, state, ids = _stream(adapter, frames, statekv.FullAttention(), fps=fps)
    prompt = torch.cat(ids + [adapter.question_ids(QUESTION, state)], dim=1)
    expected = _eagle_prompt(opening)
    assert adapter.tokenizer.decode(prompt[0]) == expected
    assert adapter.tokenizer(expected, add_special_tokens=False).input_ids == prompt[0].tolist()
    assert state.extra["fps"] == fps


@pytest.mark.parametrize("layout, expected", [
    # The paper's layout: frames first, then the chat-templated question.
    ("paper", "".join(f"<img>{CONTEXT}</img>\n" for _ in TIMESTAMPS)
     + f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"),
    # InternVL's chat(): "Frame{i}: <image>\n" per frame, then the question, in the user turn.
    ("chat", "<|im_start|>user\n" + "".join(f"Frame{i}: <img>{CONTEXT}</img>\n" for i in range(1, 5))
     + f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n"),
])
def test_internvl_layout_text(adapters, frames, layout, expected):
    adapter = adapters[layout]
    _, state, ids = _stream(adapter, frames, statekv.FullAttention())
    prompt = torch.cat(ids + [adapter.question_ids(QUESTION, state)], dim=1)
    assert adapter.tokenizer.decode(prompt[0]) == expected


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunk_boundaries_are_where_the_tokenizer_splits_anyway(adapters, frames, layout):
    """The tiny tokenizer has no merges, so equal ids alone would not catch a chunk boundary inside a word that
    real BPE merges (``fps: | Frame`` would tokenize as ``: Ġ`` + ``Frame``, not ``:`` + ``ĠFrame``)."""
    adapter = adapters[layout]
    _, state, ids = _stream(adapter, frames, statekv.FullAttention())
    texts = [adapter.tokenizer.decode(chunk[0]) for chunk in ids + [adapter.question_ids(QUESTION, state)]]
    specials = re.compile("|".join(re.escape(token) for token in adapter.tokenizer.added_tokens_encoder))
    pre_tokenizer = adapter.tokenizer.backend_tokenizer.pre_tokenizer
    for left, right in zip(texts, texts[1:]):
        tail, head = specials.split(left)[-1], specials.split(right)[0]
        if tail and head:
            starts = {start for _, (start, _) in pre_tokenizer.pre_tokenize_str(tail + head)}
            assert len(tail) in starts, (tail, head)


@pytest.mark.parametrize("declared", [15, 17])
def test_a_model_declaring_other_tokens_per_frame_than_its_tower_gives_is_refused(checkpoint, frames, declared):
    """Before: with ``num_image_token`` below what ``extract_feature`` gives, each frame's features were cut to
    the first ``num_image_token`` without a word (the model's own forward refuses such a prompt); above it, a
    bare torch error ("Number of elements of source < number of ones in mask"). Now a one-line refusal."""
    loaded = load_adapter(checkpoint, trust_remote_code=True, dtype=torch.float32)
    model = loaded.model
    model.num_image_token = declared  # remote code whose count disagrees with its own tower
    try:
        adapter = RemoteInternVLAdapter(model, loaded.tokenizer, image_size=112, image_mean=loaded.image_mean,
                                        image_std=loaded.image_std)
        assert adapter.tokens_per_image == declared
        _check_refused(adapter, frames, declared)
    finally:
        model.num_image_token = 16


def _check_refused(adapter, frames, declared):
    state = adapter.start(len(frames), FPS)
    state = state.after(adapter.prefix(state))
    with pytest.raises(UnsupportedModelError) as error:
        adapter.frames_chunk([frames[0]], state)
    assert "16 visual tokens per frame" in str(error.value) and str(declared) in str(error.value)
    assert "\n" not in str(error.value)

