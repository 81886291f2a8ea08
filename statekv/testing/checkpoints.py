"""Tiny random checkpoints of the supported families, made locally.

For trying statekv offline, for the benchmarks and for the tests: *tiny random models of the real
architectures*, saved and loaded back through the real ``from_pretrained`` path, with a tokenizer built
locally (a byte-level BPE from the ``tokenizers`` library behind transformers' ``Qwen2Tokenizer``, as the real
families use). The tiny Eagle declares Eagle2.5's own ``model_type`` (``eagle_2_5_vl``) and ships its code as
a real Eagle checkpoint does, so the production adapter serves it unchanged.

Tiny checkpoints (defaults; everything can be overridden, see `make_tiny_checkpoint`):

=========  ===========================================  ==============================================
family     vision                                       language model
=========  ===========================================  ==============================================
internvl   InternViT 2 layers, hidden 32, patch 14,     Qwen2 3 layers, hidden 64, 4 / 2 heads,
           112x112 frames -> 8x8 patches + CLS ->       head_dim 16, vocab 300, untied, dynamic RoPE
           pixel shuffle 0.5 -> 16 tokens per frame     (factor 2, theta 1e6, max_position 128)
qwen3_vl   ViT depth 3, hidden 32, patch 16, temporal   Qwen3 3 layers, hidden 64, 4 / 2 heads,
           2, merge 2, DeepStack after blocks 0 and 1;  head_dim 16, vocab 300, tied, M-RoPE
           128x128 frame pair -> 8x8 patches -> 16      interleaved, mrope_section [4, 2, 2],
           tokens per temporal patch (2 frames)         theta 5e6
eagle      SigLIP 2 layers, hidden 32, patch 14,        Qwen2 3 layers as internvl, default RoPE
           112x112 -> 8x8 patches (no CLS) -> 16        (theta 1e6), max_position 4096
           tokens per frame; mean = std = 0.5
=========  ===========================================  ==============================================

Token ids (all families): byte-level tokens 0-255, ``<|endoftext|>`` 256, ``<|im_start|>`` 257, ``<|im_end|>`` 258;
internvl / eagle: ``<img>`` 259, ``</img>`` 260, ``<IMG_CONTEXT>`` 261, ``<video>`` 262; qwen3_vl:
``<|vision_start|>`` 259, ``<|vision_end|>`` 260, ``<|vision_pad|>`` 261, ``<|image_pad|>`` 262,
``<|video_pad|>`` 263. Adapters should still read ids from the tokenizer / config, never assume them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, pre_tokenizers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    GenerationConfig,
    InternVLConfig,
    InternVLForConditionalGeneration,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Tokenizer,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    SiglipVisionConfig,
)
from transformers.configuration_utils import SubConfigSpec
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from statekv.video.preprocess import IMAGENET_MEAN, IMAGENET_STD, QWEN_MEAN, QWEN_STD

# ----------------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------------

FAMILIES = ("internvl", "qwen3_vl", "eagle")
CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_FAMILY_TOKENS = {
    "internvl": {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    },
    "qwen3_vl": {
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
        "vision_pad_token": "<|vision_pad|>",
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
    },
}
_FAMILY_TOKENS["eagle"] = _FAMILY_TOKENS["internvl"]
# What the chat template writes for {"type": "image"} / {"type": "video"} content items.
_PLACEHOLDERS = {
    "internvl": ("<IMG_CONTEXT>\n", "<video>\n"),
    "eagle": ("<IMG_CONTEXT>\n", "<video>\n"),
    "qwen3_vl": ("<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"),
}


def chatml_template(image_placeholder: str, video_placeholder: str) -> str:
    """A ChatML chat template (``<|im_start|>role\\n...<|im_end|>\\n``) whose message content is a string or a
    list of ``{"type": "text" | "image" | "video"}`` items."""
    return (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['content'] is string -%}{{- message['content'] -}}"
        "{%- else -%}{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'text' -%}{{- item['text'] -}}"
        f"{{%- elif item['type'] == 'image' -%}}{{{{- {image_placeholder!r} -}}}}"
        f"{{%- elif item['type'] == 'video' -%}}{{{{- {video_placeholder!r} -}}}}"
        "{%- endif -%}{%- endfor -%}{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def build_tokenizer(family: str) -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer (256 byte tokens, no merges) with the family's special tokens and a
    ChatML chat template. Special tokens take ids 256.. in the order of the module docstring."""
    _check_family(family)
    named = _FAMILY_TOKENS[family]
    specials = list(CHAT_TOKENS) + list(named.values())
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({token: len(vocab) + i for i, token in enumerate(specials)})
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=dict(named),
    )
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    tokenizer.chat_template = chatml_template(*_PLACEHOLDERS[family])
    return tokenizer


# ----------------------------------------------------------------------------------------------------
# Eagle stand-in (remote-code interface of Eagle2.5 and of the original InternVL3 release)
# ----------------------------------------------------------------------------------------------------


class TinyEagleConfig(PreTrainedConfig):
    """Config of `TinyEagleForConditionalGeneration`: a SigLIP vision config and a Qwen2 text config."""

    model_type = "eagle_2_5_vl"  # a stand-in for Eagle2.5: the production adapter serves it
    sub_configs_defaults = {
        "vision_config": SiglipVisionConfig,
        "text_config": SubConfigSpec(config_class=AutoConfig, model_type="qwen2"),
    }

    vision_config: dict | PreTrainedConfig | None = None
    text_config: dict | PreTrainedConfig | None = None
    downsample_ratio: float = 0.5
    select_layer: int = -1
    force_image_size: int | None = None
    image_token_id: int | None = None
    tie_word_embeddings: bool = False


class TinyEagleForConditionalGeneration(PreTrainedModel):
    """SigLIP -> pixel shuffle -> MLP projector -> Qwen2ForCausalLM, with the remote-code interface that
    Eagle2.5 and the original InternVL3 checkpoints expose: ``vision_model``, ``mlp1``, ``language_model``,
    ``extract_feature(pixel_values)``, ``img_context_token_id``, ``num_image_token``."""

    config_class = TinyEagleConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["SiglipEncoderLayer", "Qwen2DecoderLayer"]

    def __init__(self, config: TinyEagleConfig):
        super().__init__(config)
        vision, text = config.vision_config, config.text_config
        image_size = config.force_image_size or vision.image_size
        self.downsample_ratio = config.downsample_ratio
        self.num_image_token = int((image_size // vision.patch_size) ** 2 * config.downsample_ratio**2)
        self.img_context_token_id = config.image_token_id
        self.vision_model = AutoModel.from_config(vision)
        self.language_model = AutoModelForCausalLM.from_config(text)
        shuffled = vision.hidden_size * int(1 / config.downsample_ratio) ** 2
        self.mlp1 = nn.Sequential(
            nn.LayerNorm(shuffled),
            nn.Linear(shuffled, text.hidden_size),
            nn.GELU(),
            nn.Linear(text.hidden_size, text.hidden_size),
        )
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def pixel_shuffle(self, features: torch.Tensor) -> torch.Tensor:
        """[N, h, w, C] -> [N, h * r, w * r, C / r**2] for r = downsample_ratio (space to channels)."""
        n, h, w, c = features.shape
        r = self.downsample_ratio
        features = features.reshape(n, h, int(w * r), int(c / r)).permute(0, 2, 1, 3)
        features = features.reshape(n, int(w * r), int(h * r), int(c / r**2))
        return features.permute(0, 2, 1, 3).contiguous()

    def extract_feature(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] -> visual tokens for the LM [N, num_image_token, hidden]."""
        layer = self.config.select_layer
        outputs = self.vision_model(pixel_values=pixel_values, output_hidden_states=layer != -1)
        features = outputs.last_hidden_state if layer == -1 else outputs.hidden_states[layer]
        side = int(features.shape[1] ** 0.5)
        features = self.pixel_shuffle(features.reshape(features.shape[0], side, side, -1))
        return self.mlp1(features.reshape(features.shape[0], -1, features.shape[-1]))

    def _embed(self, input_ids: torch.LongTensor, pixel_values: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings [B, L, hidden] with each ``img_context_token_id`` replaced by one visual token."""
        embeds = self.get_input_embeddings()(input_ids)
        if pixel_values is None:
            return embeds
        visual = self.extract_feature(pixel_values).reshape(-1, embeds.shape[-1])
        mask = (input_ids == self.img_context_token_id).unsqueeze(-1)
        if int(mask.sum()) != visual.shape[0]:
            raise ValueError(f"{int(mask.sum())} image context tokens for {visual.shape[0]} visual tokens")
        return embeds.masked_scatter(mask, visual.to(embeds.dtype))

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """Language-model forward where each ``img_context_token_id`` position takes one visual token."""
        if inputs_embeds is None:
            inputs_embeds = self._embed(input_ids, pixel_values)
        return self.language_model(inputs_embeds=inputs_embeds, **kwargs)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.LongTensor:
        """Embed (and fill image tokens) as `forward` does, then generate with the language model."""
        if inputs_embeds is None:
            inputs_embeds = self._embed(input_ids, pixel_values)
        return self.language_model.generate(inputs_embeds=inputs_embeds, **kwargs)


# The file written next to an eagle checkpoint for ``trust_remote_code``: it re-exports the classes above.
_EAGLE_REMOTE_MODULE = "modeling_tiny_eagle"
_EAGLE_REMOTE_CODE = '''"""Remote code of a statekv tiny Eagle checkpoint; the classes live in statekv.testing."""

from statekv.testing.checkpoints import TinyEagleConfig, TinyEagleForConditionalGeneration

__all__ = ["TinyEagleConfig", "TinyEagleForConditionalGeneration"]
'''


# ----------------------------------------------------------------------------------------------------
# Tiny checkpoints
# ----------------------------------------------------------------------------------------------------

_QWEN2_TEXT = dict(
    model_type="qwen2",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "internvl": dict(
        vision_config=dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            image_size=112, patch_size=14,
        ),
        text_config=dict(
            _QWEN2_TEXT,
            max_position_embeddings=128,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
        ),
        downsample_ratio=0.5,
        tie_word_embeddings=False,
    ),
    "qwen3_vl": dict(
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
        ),
        text_config=dict(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True,
            },
        ),
        tie_word_embeddings=True,
    ),
    "eagle": dict(
        vision_config=dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            image_size=112, patch_size=14, vision_use_head=False,
        ),
        text_config=dict(
            _QWEN2_TEXT, max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        downsample_ratio=0.5,
        select_layer=-1,
    ),
}  # fmt: skip
# Per-frame pixel budget of the tiny Qwen3-VL: 64x64 (4 tokens per temporal patch) to 128x128 (16 tokens).
_QWEN_MIN_PIXELS = 64 * 64
_QWEN_MAX_TOKENS_PER_FRAME = 16


def make_tiny_checkpoint(
    family: str,
    path: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    std: float = 0.15,
    **overrides: Any,
) -> Path:
    """Write a tiny random checkpoint of ``family`` ("internvl", "qwen3_vl" or "eagle") to ``path``.

    The folder loads back with the real entry points: ``AutoModelForImageTextToText.from_pretrained`` (internvl,
    qwen3_vl; ``AutoModel`` works too), ``AutoModel.from_pretrained(path, trust_remote_code=True)`` (eagle,
    through ``auto_map`` and a remote-code file that re-exports `TinyEagleForConditionalGeneration`), and
    ``AutoTokenizer.from_pretrained``. It also holds ``generation_config.json`` and the image (and, for
    qwen3_vl, video) processor configs with the preprocessing size, mean and std.

    Every weight matrix, embedding and bias is drawn from N(0, std) with a generator seeded by ``seed``
    (std 0.15 keeps attention far from uniform); norm weights and layer scales keep their constant init.
    overrides: ``vision_config={...}`` / ``text_config={...}`` update the sub-config defaults; any other key
    sets a top-level config field. Returns ``path``.
    """
    _check_family(family)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family)
    config_kwargs = _config_kwargs(family, tokenizer, overrides)
    model = _build_model(family, config_kwargs)
    _draw_weights(model, std=std, seed=seed)
    model.to(dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    if family == "eagle":
        model.config.auto_map = {
            "AutoConfig": f"{_EAGLE_REMOTE_MODULE}.TinyEagleConfig",
            "AutoModel": f"{_EAGLE_REMOTE_MODULE}.TinyEagleForConditionalGeneration",
        }
        (path / f"{_EAGLE_REMOTE_MODULE}.py").write_text(_EAGLE_REMOTE_CODE)
    model.save_pretrained(path)
    model.generation_config.save_pretrained(path)  # save_pretrained skips it for models without GenerationMixin
    tokenizer.save_pretrained(path)
    _save_processor_configs(family, model.config, path)
    return path


def make_long_context_checkpoint(path: str | Path, *, image_size: int = 224, seed: int = 0, **overrides: Any) -> Path:
    """A tiny InternVL checkpoint (the real InternVL architecture, `make_tiny_checkpoint`'s sizes) whose language
    model takes a million positions with plain RoPE, for streams of many hours: ``image_size`` sets the tokens per
    frame (``(image_size / 14 / 2)^2``: 64 at 224, 16 at 112). ``overrides`` as `make_tiny_checkpoint`'s."""
    text = {"max_position_embeddings": 1 << 20, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            **overrides.pop("text_config", {})}
    vision = {"image_size": image_size, **overrides.pop("vision_config", {})}
    return make_tiny_checkpoint("internvl", path, seed=seed, text_config=text, vision_config=vision, **overrides)


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(FAMILIES)}")


def _config_kwargs(family: str, tokenizer: Qwen2Tokenizer, overrides: dict[str, Any]) -> dict[str, Any]:
    kwargs = copy.deepcopy(_DEFAULTS[family])
    for key in ("vision_config", "text_config"):
        kwargs[key].update(overrides.pop(key, {}))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tokenizer.get_vocab()}
    if family == "qwen3_vl":
        kwargs.update(
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
    else:
        kwargs["image_token_id"] = ids["<IMG_CONTEXT>"]
        # The Qwen2 LM builds its own generation config from these when it generates on its own (eagle).
        kwargs["text_config"].setdefault("eos_token_id", ids["<|im_end|>"])
        kwargs["text_config"].setdefault("pad_token_id", ids["<|endoftext|>"])
    if family == "internvl":
        vision = kwargs["vision_config"]
        grid = _side(vision["image_size"]) // _side(vision["patch_size"])
        kwargs["image_seq_length"] = int(grid**2 * kwargs["downsample_ratio"] ** 2)
    kwargs.update(overrides)
    return kwargs


def _build_model(family: str, config_kwargs: dict[str, Any]) -> PreTrainedModel:
    if family == "internvl":
        return InternVLForConditionalGeneration(InternVLConfig(**config_kwargs))
    if family == "qwen3_vl":
        return Qwen3VLForConditionalGeneration(Qwen3VLConfig(**config_kwargs))
    return TinyEagleForConditionalGeneration(TinyEagleConfig(**config_kwargs))


@torch.no_grad()
def _draw_weights(model: nn.Module, *, std: float, seed: int) -> None:
    """Draw every parameter with two or more dimensions, and every bias, from N(0, std), in a fixed order."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():  # tied parameters are listed once
        if parameter.ndim >= 2 or name.endswith("bias"):
            values = torch.randn(parameter.shape, generator=generator, dtype=torch.float32) * std
            parameter.copy_(values)


def _save_processor_configs(family: str, config: PreTrainedConfig, path: Path) -> None:
    if family == "qwen3_vl":
        vision = config.vision_config
        factor = vision.patch_size * vision.spatial_merge_size
        common = dict(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
            image_mean=QWEN_MEAN,
            image_std=QWEN_STD,
        )
        max_pixels = _QWEN_MAX_TOKENS_PER_FRAME * factor**2
        image_size = {"shortest_edge": _QWEN_MIN_PIXELS, "longest_edge": max_pixels}
        Qwen2VLImageProcessorPil(size=image_size, **common).save_pretrained(path)
        # The video budget is over all frames (transformers' convention); the per-frame cap is max_video_tokens.
        Qwen3VLVideoProcessor(
            size={"shortest_edge": _QWEN_MIN_PIXELS, "longest_edge": max_pixels * 64},
            max_video_tokens=_QWEN_MAX_TOKENS_PER_FRAME,
            cap_pixels_per_frame=True,
            **common,
        ).save_pretrained(path)
        return
    vision = config.vision_config
    side = getattr(config, "force_image_size", None) or _side(vision.image_size)
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if family == "internvl" else (QWEN_MEAN, QWEN_STD)
    GotOcr2ImageProcessorPil(
        size={"height": side, "width": side}, image_mean=mean, image_std=std, crop_to_patches=False
    ).save_pretrained(path)


def _side(image_size: int | Sequence[int]) -> int:
    return image_size if isinstance(image_size, int) else int(image_size[0])
