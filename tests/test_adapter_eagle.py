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
from transformers import GenerationConfig

import statekv
import statekv.models.remote_internvl  # noqa: F401  (registers the adapter)
from statekv import InputError, UnsupportedModelError
from statekv.models import adapter_for, load_adapter
from statekv.models.remote_internvl import RemoteInternVLAdapter
from statekv.testing import draw_test_frame, make_tiny_checkpoint
from statekv.video import Frame, internvl_pixel_values, open_video

from conftest import random_frames, tiny_qa

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


# ---------------------------------------------------------------------------------------------------
# Configurations Eagle checkpoints take (text model Qwen2 / Qwen3 / Llama, tied or not, RoPE scaling, the
# vision feature layer, patch size, precision): streaming equals the one-shot generate on each
# ---------------------------------------------------------------------------------------------------

EAGLE_VARIANTS = {
    "one-kv-head": dict(text_config={"num_key_value_heads": 1}),
    "kv-heads-equal-heads": dict(text_config={"num_key_value_heads": 4}),
    "head-dim-unlike-hidden-over-heads": dict(text_config={"head_dim": 32}),
    "tied": dict(tie_word_embeddings=True, text_config={"tie_word_embeddings": True}),
    "qwen3-language-model": dict(text_config={"model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": True}),
    "llama-language-model-llama3-rope": dict(text_config={"model_type": "llama", "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 5e5}}),
    "yarn": dict(text_config={"max_position_embeddings": 512, "rope_parameters": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256, "rope_theta": 1e6}}),
    "dynamic-rope-inside-trained-length": dict(text_config={"max_position_embeddings": 512, "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}),
    "qwen2.5-sliding-window-off": dict(text_config={"use_sliding_window": False, "sliding_window": 32768,
                                                    "max_window_layers": 28}),
    "second-last-vision-layer": dict(select_layer=-2),
    "patch-16": dict(vision_config={"patch_size": 16, "image_size": 128}),
    "eager-attention": dict(text_config={"attn_implementation": "eager"}),
    "bfloat16": dict(dtype=torch.bfloat16),
    "float16": dict(dtype=torch.float16),
}
VARIANT_FRAMES = 4


def _one_shot_eagle_answer(adapter, video, fps):
    """The model's own generate over the eagle layout's prompt, written out here, with every frame's pixels."""
    block = "<img>" + "<IMG_CONTEXT>" * adapter.tokens_per_image + "</img>"
    frames = "".join(f"Frame {i + 1} sample at {i / fps:.2f}s: {block}" for i in range(len(video)))
    content = f"The first video sampled with {fps:.2f} fps: {frames}{QUESTION}"
    text = adapter.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
    ids = adapter.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    assert ids.shape[1] + NEW_TOKENS <= 256  # inside every variant's trained length
    pixels = torch.stack([internvl_pixel_values(image, adapter.image_size, mean=adapter.image_mean,
                                                std=adapter.image_std) for image in video]).to(adapter.dtype)
    return adapter.model.generate(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=NEW_TOKENS, do_sample=False)


@pytest.mark.parametrize("variant", EAGLE_VARIANTS)
def test_streaming_equals_one_shot_generate_across_eagle_configurations(tmp_path, variant):
    overrides = dict(EAGLE_VARIANTS[variant])
    adapter = load_adapter(make_tiny_checkpoint("eagle", tmp_path / "ckpt", **overrides), trust_remote_code=True)
    assert adapter.dtype == overrides.get("dtype", torch.float32)
    video = random_frames(VARIANT_FRAMES, seed=3)
    # in half precision chunked and one-shot sums round apart, so near-tied greedy steps may part late
    compared = NEW_TOKENS if adapter.dtype == torch.float32 else 4
    expected = _one_shot_eagle_answer(adapter, video, fps=2.0)[:, :compared]
    for method, policy in (("full", {}), ("statekv", {"budget": 10_000})):
        encoded = tiny_qa(adapter, statekv.make_policy(method, **policy)).encode(open_video(video, fps=2), max_fps=2)
        assert encoded.state.extra["fps"] == 2.0
        assert torch.equal(encoded.ask_tokens(QUESTION, max_new_tokens=NEW_TOKENS)[:, :compared], expected), method


def test_eagle_streams_save_load_and_step_together_as_alone(checkpoint, tmp_path):
    """A saved Eagle stream (its stated rate in the layout state) resumes bit-identically, and streams with
    different stated rates (prefixes of different lengths) stepped together end as each does alone."""
    adapter = load_adapter(checkpoint, trust_remote_code=True, dtype=torch.float32)
    qa = tiny_qa(adapter, "statekv")
    video = random_frames(5)
    whole = qa.stream(horizon_frames=5, max_fps=1)
    whole.push_many((image, float(t)) for t, image in enumerate(video))
    first = qa.stream(horizon_frames=5, max_fps=1)
    first.push_many((image, float(t)) for t, image in enumerate(video[:2]))
    path = first.save(tmp_path / "eagle.safetensors")
    first.close()
    resumed = statekv.Stream.load(path, qa)
    resumed.push_many((image, float(t)) for t, image in enumerate(video[2:], start=2))
    assert resumed.state == whole.state and resumed.state.extra == {"fps": 1.0}
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=6), whole.ask_tokens(QUESTION, max_new_tokens=6))

    rates, videos = (1, 2, None), [random_frames(4, seed) for seed in range(3)]
    streams = [qa.stream(horizon_frames=4, max_fps=rate) for rate in rates]
    for tick in range(4):
        assert qa.push_many([(stream, frames[tick], float(tick)) for stream, frames in zip(streams, videos)])
    for stream in streams:
        stream.flush()
    assert qa.step_scheduler.batched_steps >= 2
    answers = qa.ask_tokens_many([(stream, QUESTION, {"max_new_tokens": 6}) for stream in streams])
    for stream, frames, rate, answer in zip(streams, videos, rates, answers):
        alone = qa.stream(horizon_frames=4, max_fps=rate)
        alone.push_many((image, float(t)) for t, image in enumerate(frames))
        assert stream.state == alone.state and stream.state.extra == {"fps": None if rate is None else float(rate)}
        assert torch.equal(answer, alone.ask_tokens(QUESTION, max_new_tokens=6))
        assert torch.equal(stream.ask_tokens(QUESTION, max_new_tokens=6), answer)


def test_an_eagle_language_model_with_sliding_window_layers_is_refused_in_one_line(tmp_path):
    path = make_tiny_checkpoint("eagle", tmp_path / "sliding", text_config={
        "use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1})
    with pytest.raises(UnsupportedModelError) as error:
        tiny_qa(load_adapter(path, trust_remote_code=True), "full").encode(random_frames(2))
    assert "sliding-window" in str(error.value) and "\n" not in str(error.value)


def test_a_watch_ends_its_answer_where_ask_does_when_the_model_configs_name_other_end_tokens(checkpoint):
    """Eagle decodes with its language model, whose generation config (from the text config) may name other end
    tokens than the whole model's ``generation_config.json``. Before: a watch stopped at the whole model's, so
    under full attention its answer was cut short of `ask`'s (documented to be exactly `ask`'s)."""
    adapter = load_adapter(checkpoint, trust_remote_code=True, dtype=torch.float32)
    stream = tiny_qa(adapter, "full").stream(horizon_frames=4)
    stream.push_many((image, float(t)) for t, image in enumerate(random_frames(4)))
    asked = stream.ask_tokens(QUESTION, max_new_tokens=NEW_TOKENS)
    im_end = adapter.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert adapter.model.language_model.generation_config.eos_token_id == im_end
    # a generation_config.json naming one more end token, which only the whole model reads
    adapter.model.generation_config = GenerationConfig(eos_token_id=[im_end, int(asked[0, 2])])
    assert int(asked[0, 2]) not in asked[0, :2].tolist()
    assert torch.equal(stream.ask_tokens(QUESTION, max_new_tokens=NEW_TOKENS), asked)  # the one-shot generate's
    watch = stream.watch(QUESTION, max_new_tokens=NEW_TOKENS)
    assert watch.evaluate() == stream.ask(QUESTION, max_new_tokens=NEW_TOKENS)


def test_the_service_labels_an_eagle_answer_by_its_language_models_end_tokens(checkpoint, tmp_path):
    """Over HTTP, an answer is called ended (finish_reason ``stop``) by the end tokens of the module that decoded it.
    Before: the service read the whole model's ``generation_config.json``, so an Eagle answer cut at its length
    whose last token only that file names an end token was labelled ``stop``."""
    from test_hostile_service import KEY, Running, _stream

    from statekv.settings import ModelOptions

    options = ModelOptions(model=str(checkpoint), method="full", trust_remote_code=True, attention="eager")
    qa = statekv.VideoQA.from_options(options)
    adapter = qa.adapter
    with Running(tmp_path / "state", qa, options=options) as server, server.client(KEY) as client:
        stream_id = _stream(client, frames=3)
        asked = {"model": str(checkpoint), "statekv": {"stream_id": stream_id},
                 "messages": [{"role": "user", "content": QUESTION}]}
        before = client.post("/v1/chat/completions", json={**asked, "max_tokens": NEW_TOKENS}).json()
        tokens = adapter.tokenizer(before["choices"][0]["message"]["content"], add_special_tokens=False).input_ids
        assert before["usage"]["completion_tokens"] == NEW_TOKENS and before["choices"][0]["finish_reason"] == "length"
        im_end = adapter.tokenizer.convert_tokens_to_ids("<|im_end|>")
        last = int(tokens[-1])
        assert last != im_end and adapter.model.language_model.generation_config.eos_token_id == im_end
        adapter.model.generation_config = GenerationConfig(eos_token_id=[im_end, last])  # read by nothing that decodes
        after = client.post("/v1/chat/completions", json={**asked, "max_tokens": NEW_TOKENS}).json()
        assert after["choices"][0]["message"] == before["choices"][0]["message"]
        assert after["choices"][0]["finish_reason"] == "length"
