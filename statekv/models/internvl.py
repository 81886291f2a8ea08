"""InternVL3 through transformers' native ``internvl`` model (the ``-hf`` checkpoints).

Every frame is one chunk: the frame is resized to the vision tower's square input (448 px for InternVL3),
encoded alone, pixel-shuffled to ``image_seq_length`` (256) visual tokens, and wrapped in ``<img>…</img>``.
Two prompt layouts:

``paper`` (default; reproduces the paper)
    ``<img>`` + visual tokens + ``</img>`` + ``\\n`` per frame (259 tokens for InternVL3), the video block
    first, then the chat-templated question. No prefix chunk.
``chat`` (the model card's and HF processor's layout)
    the chat template's user turn opened, then ``Frame{i}: <img>…</img>`` lines joined by ``\\n`` where the
    template puts its video placeholder, then the question inside the same user turn.

Chunk boundaries sit right after ``</img>`` or before ``<img>`` (special tokens the tokenizer never merges
across), so tokenizing chunk by chunk gives the same ids as tokenizing the whole prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from ..errors import InputError, UnsupportedModelError
from ..video import IMAGENET_MEAN, IMAGENET_STD, Frame, internvl_pixel_values
from .base import Chunk, LayoutState, PreparedFrames, VideoAdapter, VisualFeatures, shown_seconds
from .checkpoint_files import normalisation, square_side
from .registry import register_adapter

_QUESTION_SENTINEL = "\x00statekv-question\x00"


@register_adapter
class InternVLAdapter(VideoAdapter):
    """InternVL3 (``model_type == "internvl"``); see the module docstring for the layouts."""

    family = "internvl"
    model_types = ("internvl",)
    layouts = ("paper", "chat")
    shows_times = False  # whether `frame_text` writes the frame's time (which the stream's state then counts from)

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, layout: str | None = None,
                 image_size: int = 448, image_mean: Sequence[float] = IMAGENET_MEAN,
                 image_std: Sequence[float] = IMAGENET_STD):
        super().__init__(model, tokenizer, layout=layout)
        self.image_size = image_size
        self.image_mean, self.image_std = tuple(image_mean), tuple(image_std)
        self.image_token_id = self._image_token_id()
        self.image_block = (self.start_image_token + self.tokenizer.convert_ids_to_tokens(self.image_token_id)
                            * self.tokens_per_image + self.end_image_token)

    # -- family specifics (overridden by the remote-code adapter) ---------------------------------------
    start_image_token = "<img>"
    end_image_token = "</img>"
    video_placeholder = "<video>"  # what the chat template writes for a video item

    @classmethod
    def from_pretrained(cls, path: str | Path, *, layout: str | None = None, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None, trust_remote_code: bool = False,
                        **model_kwargs: Any) -> "InternVLAdapter":
        layout = cls.check_layout(layout)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype or "auto",
                                                            trust_remote_code=trust_remote_code, **model_kwargs)
        if device is not None:
            model = model.to(device)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        mean, std = normalisation(path, default=(IMAGENET_MEAN, IMAGENET_STD))
        return cls(model, tokenizer, layout=layout, image_size=square_side(model.config.vision_config.image_size),
                   image_mean=mean, image_std=std)

    @property
    def tokens_per_image(self) -> int:
        return int(self.model.config.image_seq_length)

    def _image_token_id(self) -> int:
        return int(self.model.config.image_token_id)

    @torch.no_grad()
    def visual_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values [N, 3, S, S]`` -> visual tokens ``[N, tokens_per_image, D]`` (vision tower + projector)."""
        config = self.model.config
        return self.model.get_image_features(
            pixel_values=pixel_values.to(self.device, self.dtype),
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        ).pooler_output

    # -- layout -----------------------------------------------------------------------------------------
    def max_video_tokens(self, num_frames: int, *, frame_size: tuple[int, int] | None = None) -> int:
        widest = self.frame_text(max(num_frames - 1, 0), 0.0)
        return self.count_tokens(self._prefix_text() or "") + num_frames * self.count_tokens(widest)

    def min_video_tokens(self, num_frames: int, *, frame_size: tuple[int, int] | None = None) -> int:
        return self.count_tokens(self._prefix_text() or "") + num_frames * self.count_tokens(self.image_block)

    def prefix(self, state: LayoutState) -> Chunk | None:
        text = self._prefix_text()
        return self.text_chunk(text, state) if text else None

    def frame_text(self, index: int, timestamp: float) -> str:
        """The text of frame ``index`` (0-based), its visual tokens written as placeholder tokens."""
        if self.layout == "paper":
            return f"{self.image_block}\n"
        separator = "\n" if index else ""
        return f"{separator}Frame{index + 1}: {self.image_block}"

    def prepare_frames(self, frames: Sequence[Frame], state: LayoutState) -> PreparedFrames:
        """One frame resized and normalised: ``pixel_values [1, 3, S, S]``."""
        if len(frames) != 1:
            raise InputError(f"{self.family} streams one frame per chunk, got {len(frames)}")
        pixels = internvl_pixel_values(frames[0].image, self.image_size, mean=self.image_mean, std=self.image_std)
        return PreparedFrames(frames=tuple(frames), pixel_values=pixels.unsqueeze(0))

    @torch.no_grad()
    def encode_vision(self, steps: Sequence[PreparedFrames]) -> list[VisualFeatures]:
        """Every step's frames in one batch ``[N, 3, S, S]``; each step gets its ``[tokens_per_image, D]``."""
        features = self.visual_features(torch.cat([step.pixel_values for step in steps]))
        features = features.reshape(len(steps), -1, features.shape[-1])
        if features.shape[1] != self.tokens_per_image:  # each frame's block has tokens_per_image slots to fill
            raise UnsupportedModelError(f"the vision tower gives {features.shape[1]} visual tokens per frame but the "
                                        f"model declares {self.tokens_per_image} image tokens per frame; its "
                                        "checkpoint is inconsistent and cannot be streamed")
        return [VisualFeatures(embeds=step_features) for step_features in features]

    @torch.no_grad()
    def features_chunk(self, step: PreparedFrames, features: VisualFeatures, state: LayoutState) -> Chunk:
        seconds, origin = shown_seconds(step.frames, state)
        ids = self.tokenize(self.frame_text(state.frames, seconds[0]))
        embeds = self.language_embeddings(ids)
        slots = (ids == self.image_token_id).unsqueeze(-1)
        embeds = embeds.masked_scatter(slots, features.embeds.to(embeds.device, embeds.dtype))
        return Chunk(input_ids=ids, inputs_embeds=embeds, position_ids=None,
                     next_position=state.next_position + ids.shape[1], frames=1,
                     state_update=origin if self.shows_times else {})

    def question_ids(self, question: str, state: LayoutState) -> torch.Tensor:
        if self.layout == "paper":
            return self.question_tokens(question, lambda text: self.tokenizer.apply_chat_template(
                [{"role": "user", "content": [{"type": "text", "text": text}]}],
                tokenize=False, add_generation_prompt=True))
        return self.question_tokens(question, lambda text: self._chat_turn_around_video(text)[1])

    def structure_tokens(self) -> tuple[str, ...]:
        """The frame's markup and the chat template's video placeholder."""
        return (self.start_image_token, self.end_image_token,
                self.tokenizer.convert_ids_to_tokens(self.image_token_id), self.video_placeholder)

    # -- internals --------------------------------------------------------------------------------------
    def _prefix_text(self) -> str | None:
        return self._chat_turn_around_video(_QUESTION_SENTINEL)[0] if self.layout == "chat" else None

    def _chat_turn_around_video(self, question: str) -> tuple[str, str]:
        """The chat template's user turn (video + question) split at the video: (before, after)."""
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}],
            tokenize=False, add_generation_prompt=True)
        before, found, after = rendered.partition(self.video_placeholder)
        if not found:
            raise InputError(f"the chat template of this checkpoint writes no {self.video_placeholder!r} for a "
                             "video; use layout='paper'")
        return before, after

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes (no special tokens added)."""
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)
