"""The built-in model's architecture and tokenizer: a small InternVL3 (``-hf``) made of transformers' own classes.

=========  ==========================================================================================
part       configuration
=========  ==========================================================================================
vision     InternViT (``InternVLVisionModel``): 2 layers, hidden 64, 2 heads, MLP 256, patch 14;
           28 x 28 frames -> 2 x 2 patches (+ CLS, dropped) -> pixel shuffle 0.5 -> 1 token per frame
projector  InternVL's multi-modal projector (LayerNorm, Linear, GELU, Linear) -> 128
language   Qwen2: 4 layers, hidden 128, 4 query / 2 KV heads (head_dim 32), MLP 512, RoPE theta 10^4,
           tied input and output embeddings
tokenizer  byte-level BPE (``tokenizers``) trained on the synthetic benchmark's prompts, so every word of
           its questions is one token and each time anchor ``Frame{i}: `` (i <= 512) of InternVL's ``chat``
           layout is one token; any other text still encodes, byte by byte. ChatML chat template.
=========  ==========================================================================================

The model is streamed with InternVL's ``chat`` prompt layout (``Frame{i}:`` lines inside the user turn):
4 tokens per frame (anchor, ``<img>``, the visual token, ``</img>``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, InternVLConfig, InternVLForConditionalGeneration, PreTrainedTokenizerFast

from ..synthetic.plans import plan_video
from ..synthetic.prompts import question_prompt
from ..synthetic.scenes import COLOURS, SHAPES
from ..synthetic.tasks import QUARTERS, ask_all

LAYOUT = "chat"
IMAGE_SIZE = 28
MAX_ANCHOR = 512  # frames whose time anchor is one token
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- elif item['type'] == 'image' -%}{{- '<IMG_CONTEXT>\\n' -}}"
    "{%- elif item['type'] == 'video' -%}{{- '<video>\\n' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Words stay whole with the space or newline before them, time anchors stay whole, the rest splits into runs.
_PIECES = r"\n?Frame\d+: |[ \n]?[A-Za-z']+|[ \n]?\d+|[ \n]?[^\sA-Za-z\d']+|\s+"

VISION_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                     image_size=IMAGE_SIZE, patch_size=14)
TEXT_CONFIG = dict(model_type="qwen2", hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, tie_word_embeddings=True)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in tokenizer (deterministic: trained on a fixed corpus of the benchmark's prompts)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PIECES), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    # A vocabulary larger than the corpus needs: merging goes on until every piece of the corpus is one token.
    trainer = trainers.BpeTrainer(vocab_size=100_000, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(), trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                      extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                                                            "context_image_token": "<IMG_CONTEXT>",
                                                            "video_token": "<video>"})
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _corpus() -> Iterator[str]:
    """Every piece of text the model is trained on: time anchors, chat markup, the questions' words."""
    yield "Frame1: "
    for index in range(2, MAX_ANCHOR + 1):
        yield f"\nFrame{index}: "
    yield "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
    yield " " + " ".join([*COLOURS, *SHAPES, *QUARTERS, "grey", "nothing", "object"])
    rng = np.random.default_rng(0)
    for _ in range(64):
        for spec in ask_all(plan_video(rng), rng):
            yield "\n" + question_prompt(spec.question, spec.options)


def build_config(tokenizer: PreTrainedTokenizerFast) -> InternVLConfig:
    """The InternVL3 config of the built-in model for ``tokenizer``'s vocabulary."""
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)), strict=True))
    text = dict(TEXT_CONFIG, vocab_size=len(tokenizer), eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    grid = IMAGE_SIZE // VISION_CONFIG["patch_size"]
    return InternVLConfig(vision_config=dict(VISION_CONFIG), text_config=text, image_token_id=ids["<IMG_CONTEXT>"],
                          image_seq_length=int(grid * grid * 0.25), downsample_ratio=0.5,
                          tie_word_embeddings=True)


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> InternVLForConditionalGeneration:
    """A freshly initialised built-in model (transformers' own initialisation, seeded)."""
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(build_config(tokenizer))
    model.generation_config = generation_config(tokenizer)
    return model


def generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    return GenerationConfig(eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>")],
                            pad_token_id=tokenizer.pad_token_id, do_sample=False)


def count_parameters(parameters: Iterable[torch.nn.Parameter]) -> int:
    return sum(parameter.numel() for parameter in parameters)
