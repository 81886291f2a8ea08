"""statekv.testing.make_tiny_checkpoint: tiny random checkpoints that load through the real from_pretrained path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoImageProcessor, AutoModel, AutoModelForImageTextToText, AutoTokenizer

from statekv.testing import make_tiny_checkpoint, write_test_video
from statekv.video import internvl_pixel_values, open_video, qwen_frame_size, qwen_pixel_values, temporal_groups

FAMILIES = ["internvl", "qwen3_vl", "eagle"]
TOKENS_PER_FRAME = 16  # internvl / eagle: per 112x112 frame; qwen3_vl: per 128x128 frame pair


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_checkpoint(family, root / family) for family in FAMILIES}


def _load(family: str, path: Path):
    if family == "eagle":
        model = AutoModel.from_pretrained(path, trust_remote_code=True)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    else:
        model = AutoModelForImageTextToText.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return {family: _load(family, path) for family, path in checkpoints.items()}


def _ids(tokenizer, *tokens: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids(list(tokens))


# ---------------------------------------------------------------------------------------------------
# Loading, configs, tokenizer
# ---------------------------------------------------------------------------------------------------


def test_internvl_loads_as_the_native_transformers_model(loaded):
    model, tokenizer = loaded["internvl"]
    config = model.config
    assert type(model).__name__ == "InternVLForConditionalGeneration" and config.model_type == "internvl"
    assert config.text_config.model_type == "qwen2" and config.text_config.num_hidden_layers == 3
    assert (config.text_config.num_attention_heads, config.text_config.num_key_value_heads) == (4, 2)
    assert config.vision_config.num_hidden_layers == 2
    assert config.text_config.rope_parameters["rope_type"] == "dynamic"
    assert config.text_config.rope_parameters["factor"] == 2.0
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>") == 261
    assert config.image_seq_length == TOKENS_PER_FRAME
    assert (tokenizer.start_image_token, tokenizer.end_image_token, tokenizer.context_image_token) == (
        "<img>", "</img>", "<IMG_CONTEXT>",
    )  # fmt: skip
    assert model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr()


def test_qwen3_vl_loads_as_the_native_transformers_model(loaded):
    model, tokenizer = loaded["qwen3_vl"]
    config = model.config
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    text, vision = config.text_config, config.vision_config
    assert (text.num_hidden_layers, text.head_dim, vision.depth) == (3, 16, 3)
    assert text.rope_parameters["mrope_section"] == [4, 2, 2] and text.rope_parameters["mrope_interleaved"]
    assert sum(text.rope_parameters["mrope_section"]) == text.head_dim // 2
    assert list(vision.deepstack_visual_indexes) == [0, 1]
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (16, 2, 2)
    expected = _ids(tokenizer, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    ids = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    assert ids == expected


def test_eagle_loads_through_remote_code(checkpoints, loaded):
    path = checkpoints["eagle"]
    config_json = json.loads((path / "config.json").read_text())
    module, _ = config_json["auto_map"]["AutoModel"].split(".")
    assert (path / f"{module}.py").exists()
    assert type(AutoConfig.from_pretrained(path, trust_remote_code=True)).__name__ == "TinyEagleConfig"
    model, tokenizer = loaded["eagle"]
    assert type(model).__name__ == "TinyEagleForConditionalGeneration"
    assert type(model.language_model).__name__ == "Qwen2ForCausalLM"
    assert type(model.vision_model).__name__ == "SiglipVisionModel"
    assert model.img_context_token_id == tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert model.language_model.config.num_hidden_layers == 3 and model.vision_model.config.num_hidden_layers == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_round_trips_and_chat_template_renders(family, loaded):
    _, tokenizer = loaded[family]
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    messages = [{"role": "user", "content": "What colour is the square?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat colour is the square?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and tokenizer.decode(ids) == text
    assert max(ids) < loaded[family][0].config.get_text_config().vocab_size
    video_turn = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Why?"}]}]
    rendered = tokenizer.apply_chat_template(video_turn, tokenize=False)
    assert rendered.endswith("Why?<|im_end|>\n")
    assert ("<|video_pad|>" if family == "qwen3_vl" else "<video>") in rendered
    assert tokenizer.eos_token == "<|im_end|>"


def test_generation_config_stops_at_im_end(checkpoints, loaded):
    from transformers import GenerationConfig

    for family, (model, tokenizer) in loaded.items():
        # read from the folder: whether a remote-code model object carries it depends on how transformers
        # loaded its class before (it adds GenerationMixin only to classes it has not registered yet)
        config = GenerationConfig.from_pretrained(checkpoints[family])
        assert tokenizer.convert_tokens_to_ids("<|im_end|>") in config.eos_token_id


@pytest.mark.parametrize("family", FAMILIES)
def test_processor_config_is_saved_for_the_adapter(family, checkpoints):
    processor = AutoImageProcessor.from_pretrained(checkpoints[family], trust_remote_code=family == "eagle")
    if family == "qwen3_vl":
        assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (16, 2, 2)
        assert list(processor.image_mean) == [0.5] * 3
        video = json.loads((checkpoints[family] / "video_preprocessor_config.json").read_text())
        assert (video["patch_size"], video["max_video_tokens"], video["size"]["shortest_edge"]) == (16, 16, 64 * 64)
    else:
        assert (processor.size["height"], processor.size["width"]) == (112, 112)
        expected_mean = [0.485, 0.456, 0.406] if family == "internvl" else [0.5] * 3
        assert list(processor.image_mean) == pytest.approx(expected_mean)


# ---------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_are_drawn_with_std_015(family, checkpoints):
    tensors = load_file(checkpoints[family] / "model.safetensors")
    drawn = [t for name, t in tensors.items() if t.ndim >= 2 or name.endswith("bias")]
    pooled = torch.cat([t.flatten() for t in drawn])
    assert pooled.numel() > 50_000
    assert abs(pooled.std().item() - 0.15) < 0.003 and abs(pooled.mean().item()) < 0.003
    for name, tensor in tensors.items():
        if tensor.ndim >= 2 and tensor.numel() >= 2000:
            assert abs(tensor.std().item() - 0.15) < 0.015, name
        if name.endswith("norm.weight"):  # norms keep their constant init
            assert torch.all(tensor == 1), name


def test_weights_depend_only_on_the_seed(tmp_path, checkpoints):
    same = load_file(make_tiny_checkpoint("internvl", tmp_path / "same", seed=0) / "model.safetensors")
    other = load_file(make_tiny_checkpoint("internvl", tmp_path / "other", seed=1) / "model.safetensors")
    reference = load_file(checkpoints["internvl"] / "model.safetensors")
    assert same.keys() == reference.keys()
    assert all(torch.equal(same[name], reference[name]) for name in reference)
    assert not any(torch.equal(other[name], reference[name]) for name in reference if reference[name].ndim >= 2)


def test_dtype_and_overrides(tmp_path):
    path = make_tiny_checkpoint(
        "internvl",
        tmp_path / "bf16",
        dtype=torch.bfloat16,
        vision_config={"image_size": 56},
        text_config={"num_hidden_layers": 2},
    )
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    assert model.config.image_seq_length == 4 and model.config.text_config.num_hidden_layers == 2
    assert AutoImageProcessor.from_pretrained(path).size["height"] == 56
    with pytest.raises(ValueError, match="unknown model family"):
        make_tiny_checkpoint("llava", tmp_path / "nope")


# ---------------------------------------------------------------------------------------------------
# Forward passes with visual inputs
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    """Four sampled frames (RGB uint8 128x128) of a synthetic 4 s video, read with statekv.video."""
    path = write_test_video(tmp_path_factory.mktemp("clip") / "clip.mp4", frames=120, fps=30, size=(128, 128))
    return [frame.image for frame in open_video(path).sample()]


def _internvl_style_ids(tokenizer, num_frames: int) -> torch.Tensor:
    """The paper's layout: per frame <img> + 16 x <IMG_CONTEXT> + </img> + newline, then a question."""
    start, end, context = _ids(tokenizer, "<img>", "</img>", "<IMG_CONTEXT>")
    newline = tokenizer("\n", add_special_tokens=False).input_ids
    frame = [start] + [context] * TOKENS_PER_FRAME + [end] + newline
    assert len(frame) == TOKENS_PER_FRAME + 3
    question = tokenizer("<|im_start|>user\nWhat moves?<|im_end|>\n", add_special_tokens=False).input_ids
    return torch.tensor([frame * num_frames + question])


def _internvl_inputs(family, loaded, checkpoints, frames):
    model, tokenizer = loaded[family]
    side = AutoImageProcessor.from_pretrained(checkpoints[family], trust_remote_code=True).size["height"]
    pixel_values = torch.stack([internvl_pixel_values(f, side) for f in frames])
    return model, dict(input_ids=_internvl_style_ids(tokenizer, len(frames)), pixel_values=pixel_values)


def _qwen_inputs(loaded, frames):
    model, tokenizer = loaded["qwen3_vl"]
    size = qwen_frame_size(*frames[0].shape[:2], min_pixels=64 * 64, max_pixels=16 * 32 * 32)
    assert size == (128, 128)
    patches = [qwen_pixel_values(list(pair), size) for pair in temporal_groups(frames, 2)]
    start, end, pad = _ids(tokenizer, "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")
    chunk = [start] + [pad] * TOKENS_PER_FRAME + [end]
    input_ids = torch.tensor([chunk * len(patches) + tokenizer("Why?", add_special_tokens=False).input_ids])
    return model, dict(
        input_ids=input_ids,
        pixel_values_videos=torch.cat([p for p, _ in patches]),
        video_grid_thw=torch.cat([g for _, g in patches]),
        mm_token_type_ids=(input_ids == pad).int() * 2,  # text 0, image 1, video 2
    )


def _inputs(family, loaded, checkpoints, frames):
    if family == "qwen3_vl":
        return _qwen_inputs(loaded, frames)
    return _internvl_inputs(family, loaded, checkpoints, frames)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_with_frames_is_deterministic_and_sees_the_pixels(family, loaded, checkpoints, frames):
    model, inputs = _inputs(family, loaded, checkpoints, frames)
    with torch.no_grad():
        first = model(**inputs).logits
        second = model(**inputs).logits
        pixels_key = "pixel_values_videos" if family == "qwen3_vl" else "pixel_values"
        flipped = model(**{**inputs, pixels_key: inputs[pixels_key].flip(0)}).logits
    assert first.shape == (1, inputs["input_ids"].shape[1], 300)
    assert torch.isfinite(first).all()
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    assert (first - flipped).abs().max() > 1e-3  # the visual tokens reach the language model
    probabilities = first[0, -1].softmax(-1)
    assert probabilities.max() > 5 / 300  # std 0.15 weights: far from a uniform next-token distribution


def test_tokens_per_frame_internvl(loaded, checkpoints, frames):
    model, inputs = _internvl_inputs("internvl", loaded, checkpoints, frames[:2])
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
    assert features.shape == (2, TOKENS_PER_FRAME, 64)


def test_tokens_per_frame_eagle(loaded, checkpoints, frames):
    model, inputs = _internvl_inputs("eagle", loaded, checkpoints, frames[:2])
    assert model.num_image_token == TOKENS_PER_FRAME
    with torch.no_grad():
        assert model.extract_feature(inputs["pixel_values"]).shape == (2, TOKENS_PER_FRAME, 64)


def test_tokens_per_temporal_patch_qwen3_vl(loaded, frames):
    model, inputs = _qwen_inputs(loaded, frames)
    assert inputs["video_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]]
    with torch.no_grad():
        output = model.model.get_video_features(
            pixel_values_videos=inputs["pixel_values_videos"], video_grid_thw=inputs["video_grid_thw"]
        )
    assert [f.shape for f in output.pooler_output] == [(TOKENS_PER_FRAME, 64)] * 2
    assert len(output.deepstack_features) == 2  # one per DeepStack layer, added after LM layers 0 and 1


def test_internvl_rope_is_really_dynamic(loaded):
    model, _ = loaded["internvl"]
    rotary = model.model.language_model.rotary_emb
    original = rotary.inv_freq.clone()
    with torch.no_grad():
        model.model.language_model(input_ids=torch.zeros(1, 200, dtype=torch.long))  # past max_position 128
    changed = not torch.equal(rotary.inv_freq, original)
    with torch.no_grad():
        model.model.language_model(input_ids=torch.zeros(1, 8, dtype=torch.long))  # back to the original scale
    assert changed and torch.equal(rotary.inv_freq, original)


def test_eagle_generate_stops_and_language_model_attention_can_be_switched(loaded, checkpoints, frames):
    model, inputs = _internvl_inputs("eagle", loaded, checkpoints, frames[:1])
    output = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert output.shape[0] == 1 and 1 <= output.shape[1] <= 4
    model.set_attn_implementation({"text_config": "eager"})
    try:
        assert model.language_model.config._attn_implementation == "eager"
        assert model.vision_model.config._attn_implementation != "eager"
    finally:
        model.set_attn_implementation({"text_config": "sdpa"})
