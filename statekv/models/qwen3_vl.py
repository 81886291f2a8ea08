"""Qwen3-VL through transformers' native ``qwen3_vl`` model.

Prompt layout (what ``Qwen3VLProcessor`` makes of the chat template's video item, split into chunks)::

    prefix      <chat template up to the video>  <|vision_start|>                (the processor's outer start)
    chunk i     <{t:.1f} seconds> <|vision_start|> <|video_pad|> x n <|vision_end|>   (one temporal patch)
    question    <|vision_end|> question <end of the user turn, assistant opening>      (the outer end)

One chunk is one temporal patch of ``frames_per_step = 2`` sampled frames (a lone last frame is repeated,
as the processor pads the last patch); ``t`` is the mean of the patch's first and last frame timestamps (as
`shown_seconds` shows them: their own, unless a stream was timed by another clock).
Chunk boundaries sit next to special tokens, so tokenizing chunk by chunk gives the ids of the whole prompt.

Positions: M-RoPE ``[4, 1, T]`` per chunk (a row of sequence indices, then the temporal / height / width rows
of the model's own ``get_rope_index`` on the chunk alone, shifted to ``state.next_position``): they depend
only on what is to the left, so the chunks' positions concatenated equal those of the whole prompt. The
vision tower attends within one temporal patch, so encoding a chunk's frames alone equals encoding the video
at once; the chunk's DeepStack features go to the decoder as ``visual_pos_masks`` /
``deepstack_visual_embeds``. Decoding passes explicit positions continuing from ``state.next_position``, so the
model's sticky ``rope_deltas`` is neither read nor changed.

Resolution is chosen once per video, from the first frame's size, and kept in ``LayoutState.extra``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

from ..core.answering.decoding import Prompt

from ..errors import ConfigurationError, InputError, UnsupportedModelError
from ..video import Frame, qwen_frame_size, qwen_pixel_values
from .base import Chunk, LayoutState, PreparedFrames, VideoAdapter, VisualFeatures, shown_seconds
from .checkpoint_files import checkpoint_json, processor_chat_template
from .registry import checkpoint_model_type, register_adapter

_QUESTION_SENTINEL = "STATEKV_QUESTION_SLOT"
_MAX_ASPECT_RATIO = 200  # both resize rules refuse frames more elongated than this
_MAX_TIMESTAMP = "999999.9"  # the longest "<t seconds>" text max_video_tokens allows for (over 11 days)
# mm_token_type_ids values of get_rope_index
_TEXT, _VIDEO = 0, 2


@dataclass(frozen=True)
class QwenVideoSettings:
    """The checkpoint's video preprocessing, as ``Qwen3VLVideoProcessor`` would apply it.

    min_pixels / max_pixels: the processor's ``size`` (``shortest_edge`` / ``longest_edge``), a pixel budget
    over all frames of a video. max_frame_tokens: its per-frame cap ``max_video_tokens`` (merged tokens),
    applied when ``cap_pixels_per_frame`` is set.
    """

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    min_pixels: int
    max_pixels: int
    max_frame_tokens: int
    cap_pixels_per_frame: bool

    @property
    def factor(self) -> int:
        """Pixels per side of one merged visual token."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "QwenVideoSettings":
        """Read ``video_preprocessor_config.json`` (else ``preprocessor_config.json``); unset fields take the
        processor class's defaults."""
        config = checkpoint_json(path, "video_preprocessor_config.json", "preprocessor_config.json") or {}
        try:
            return cls._from_config(config)
        except (AttributeError, TypeError, ValueError) as error:
            raise InputError(f"{path}: its video preprocessing config is malformed ({error})") from None

    @classmethod
    def _from_config(cls, config: dict[str, Any]) -> "QwenVideoSettings":
        defaults = Qwen3VLVideoProcessor
        size = config.get("size") or {}
        settings = cls(
            patch_size=int(config.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(config.get("temporal_patch_size", defaults.temporal_patch_size)),
            merge_size=int(config.get("merge_size", defaults.merge_size)),
            image_mean=tuple(config.get("image_mean", defaults.image_mean)),
            image_std=tuple(config.get("image_std", defaults.image_std)),
            min_pixels=int(size.get("shortest_edge", config.get("min_pixels", defaults.size["shortest_edge"]))),
            max_pixels=int(size.get("longest_edge", config.get("max_pixels", defaults.size["longest_edge"]))),
            max_frame_tokens=int(config.get("max_video_tokens", defaults.max_video_tokens)),
            cap_pixels_per_frame=bool(config.get("cap_pixels_per_frame", defaults.cap_pixels_per_frame)),
        )
        sizes = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "max_frame_tokens")
        for name in sizes:
            if getattr(settings, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(settings, name)}")
        if len(settings.image_mean) != 3 or len(settings.image_std) != 3:
            raise ValueError("image_mean and image_std must hold one value per colour channel")
        return settings

    # -- resolution -------------------------------------------------------------------------------------
    def frame_size(self, height: int, width: int, num_frames: int | None,
                   tokens_per_frame: int | None = None) -> tuple[int, int]:
        """(height, width) every frame of a video is resized to, from the first frame's size.

        tokens_per_frame: a per-frame budget in merged tokens (``factor**2`` pixels each). Without it, a
        video of known length gets what transformers' video processor chooses for ``num_frames`` frames
        (its budget is over the whole video and its rounding depends on the frame count, so it is called as
        is), and an open-ended stream (``num_frames is None``) the per-frame cap.
        """
        if tokens_per_frame is not None or num_frames is None:
            budget = (tokens_per_frame or self.max_frame_tokens) * self.factor**2
            return qwen_frame_size(height, width, min_pixels=min(self.min_pixels, budget), max_pixels=budget,
                                   factor=self.factor)
        # The processor cannot resize fewer frames than one temporal patch; the patch repeats the frame.
        num_frames = max(num_frames, self.temporal_patch_size)
        return smart_resize(num_frames, height, width, temporal_factor=self.temporal_patch_size,
                            factor=self.factor, min_pixels=self.min_pixels,
                            max_pixels=self._per_frame_pixels(num_frames) * num_frames)

    def max_patch_tokens(self, num_frames: int | None, tokens_per_frame: int | None = None) -> int:
        """An upper bound on the visual tokens of one temporal patch whatever the frames' size.

        Three cases of both resize rules, for a per-frame budget ``P`` and floor ``m``: rounding alone keeps
        the area within ``P`` (within ``1.25 P`` for transformers' rule, which rounds the frame count of odd
        videos to an even one); shrinking keeps it within ``P`` unless the short side is held at one factor,
        where the long side is at most ``sqrt(200 P)``; growing to ``m`` overshoots by less than one factor on
        each side of an at most 200:1 frame.
        """
        if tokens_per_frame is not None or num_frames is None:
            budget = (tokens_per_frame or self.max_frame_tokens) * self.factor**2
            floor, slack = min(self.min_pixels, budget), 1.0
        else:
            num_frames = max(num_frames, self.temporal_patch_size)
            budget, floor, slack = self._per_frame_pixels(num_frames), self.min_pixels / num_frames, 1.25
        unit = self.factor
        rounded = slack * budget / unit**2
        one_row = math.sqrt(_MAX_ASPECT_RATIO * budget) / unit
        grown = floor / unit**2 + math.sqrt(floor) * (math.sqrt(_MAX_ASPECT_RATIO) + 1) / unit + 1
        return math.ceil(max(rounded, one_row, grown))

    def _per_frame_pixels(self, num_frames: int) -> int:
        """The processor's per-frame share of its pixel budget (its ``resize`` with ``cap_pixels_per_frame``)."""
        if not self.cap_pixels_per_frame:
            return self.max_pixels // num_frames
        frame_cap = self.max_frame_tokens * self.factor**2
        return max(min(frame_cap, self.max_pixels // num_frames), int(self.min_pixels * 1.05))


@register_adapter
class Qwen3VLAdapter(VideoAdapter):
    """Qwen3-VL (``model_type == "qwen3_vl"``): one temporal patch (2 frames) per chunk, M-RoPE, DeepStack.

    settings: the checkpoint's video preprocessing (`QwenVideoSettings.from_pretrained`).
    tokens_per_frame: per-frame resolution budget in visual tokens (a temporal patch of two frames yields
        that many tokens); ``None`` resizes as transformers' video processor does for the video's length.
    chat_template: the template to lay the prompt out with; default the tokenizer's.
    """

    family = "qwen3_vl"
    model_types = ("qwen3_vl",)
    frames_per_step = 2

    def __init__(self, model: torch.nn.Module, tokenizer: Any, settings: QwenVideoSettings, *,
                 layout: str | None = None, tokens_per_frame: int | None = None,
                 chat_template: str | None = None):
        super().__init__(model, tokenizer, layout=layout)
        vision = model.config.vision_config
        # a disagreement would lay patches out in an order the tower does not read, silently
        for field, tower_field in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                                   ("temporal_patch_size", "temporal_patch_size")):
            ours, tower = getattr(settings, field), getattr(vision, tower_field)
            if ours != tower:
                raise InputError(f"the video preprocessing config says {field} {ours}, but the vision tower's "
                                 f"{tower_field} is {tower}")
        if settings.temporal_patch_size != self.frames_per_step:
            raise UnsupportedModelError(f"{self.family} streams {self.frames_per_step} frames per chunk, but this "
                                        f"checkpoint's temporal patch is {settings.temporal_patch_size} frames")
        if tokens_per_frame is not None and not _positive_int(tokens_per_frame):
            raise ConfigurationError(f"tokens_per_frame must be a positive integer, got {tokens_per_frame!r}")
        self.settings = settings
        self.tokens_per_frame = tokens_per_frame
        config = model.config
        self.video_token_id = int(config.video_token_id)
        self.vision_start_id = int(config.vision_start_token_id)
        self.vision_end_id = int(config.vision_end_token_id)
        self.prefix_text, self.question_open, self.question_close = self._split_chat_template(
            chat_template or tokenizer.chat_template)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, layout: str | None = None, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None, trust_remote_code: bool = False,
                        tokens_per_frame: int | None = None, **model_kwargs: Any) -> "Qwen3VLAdapter":
        """Load model, tokenizer and video preprocessing settings from a checkpoint folder or hub id."""
        layout = cls.check_layout(layout)
        model_type = checkpoint_model_type(path)
        if model_type not in cls.model_types:
            raise UnsupportedModelError(f"{path} is a {model_type!r} checkpoint, not {cls.family}")
        config = checkpoint_json(path, "config.json") or {}
        missing = [name for name in ("text_config", "vision_config") if not isinstance(config.get(name), dict)]
        if missing:  # transformers would build its default sizes (an 8B model) before reading a weight
            raise InputError(f"{path}: its config.json has no {' or '.join(missing)}; a {cls.family} checkpoint's "
                             "names the sizes of its language model and vision tower")
        try:
            model = AutoModelForImageTextToText.from_pretrained(
                path, dtype=dtype or "auto", trust_remote_code=trust_remote_code, **model_kwargs)
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            settings = QwenVideoSettings.from_pretrained(path)
        except (OSError, json.JSONDecodeError) as error:
            raise InputError(f"cannot load {path}: {str(error).splitlines()[0]}") from None
        if device is not None:
            model = model.to(device)
        return cls(model, tokenizer, settings, layout=layout, tokens_per_frame=tokens_per_frame,
                   chat_template=tokenizer.chat_template or processor_chat_template(path))

    # -- planning ---------------------------------------------------------------------------------------
    def max_video_tokens(self, num_frames: int, *, frame_size: tuple[int, int] | None = None) -> int:
        """Prefix plus ``ceil(num_frames / 2)`` chunks, each with the longest timestamp text (its UTF-8
        bytes: a byte-level tokenizer never needs more tokens) and the most visual tokens a frame can get.

        frame_size: (height, width) of the video's first frame, when known: the visual tokens are then exact
            (the bound otherwise allows for any aspect ratio, up to about twice the typical count).
        """
        _check_frame_count(num_frames, allow_none=False)
        chunks = math.ceil(num_frames / self.frames_per_step)
        timestamp = len(f"<{_MAX_TIMESTAMP} seconds>".encode())
        patch = (self.settings.max_patch_tokens(num_frames, self.tokens_per_frame) if frame_size is None
                 else self._patch_tokens(num_frames, frame_size))
        return self._count(self.prefix_text) + chunks * (timestamp + 2 + patch)

    def min_video_tokens(self, num_frames: int, *, frame_size: tuple[int, int] | None = None) -> int:
        """Prefix plus ``ceil(num_frames / 2)`` chunks, each with a timestamp of one token at least and, for a
        known ``frame_size``, its visual tokens (none counted otherwise)."""
        _check_frame_count(num_frames, allow_none=False)
        patch = 0 if frame_size is None else self._patch_tokens(num_frames, frame_size)
        return self._count(self.prefix_text) + math.ceil(num_frames / self.frames_per_step) * (1 + 2 + patch)

    def _patch_tokens(self, num_frames: int, frame_size: tuple[int, int]) -> int:
        """The visual tokens of one temporal patch of a video of ``num_frames`` frames of ``frame_size``."""
        try:
            height, width = self.settings.frame_size(*frame_size, num_frames, self.tokens_per_frame)
        except (TypeError, ValueError) as error:
            raise InputError(f"frame_size must be a (height, width) {self.family} can resize: {error}") from None
        return height * width // self.settings.factor**2

    # -- streaming --------------------------------------------------------------------------------------
    def start(self, num_frames: int | None = None, fps: float | None = None) -> LayoutState:
        """Records the frame count for the resolution rule (``None``: an open-ended stream). ``fps`` is not
        needed: the timestamps in the prompt come from the frames themselves."""
        _check_frame_count(num_frames, allow_none=True)
        return LayoutState(extra={"num_frames": num_frames})

    def prefix(self, state: LayoutState) -> Chunk:
        """The chat template up to the video, then the outer ``<|vision_start|>``."""
        return self.text_chunk(self.prefix_text, state)

    def text_chunk(self, text: str, state: LayoutState) -> Chunk:
        """Text at M-RoPE positions continuing from ``state`` (all three rows equal)."""
        ids = self.tokenize(text)
        return Chunk(input_ids=ids, inputs_embeds=self.language_embeddings(ids),
                     position_ids=self.text_positions(state, ids.shape[1]),
                     next_position=state.next_position + ids.shape[1])

    def prepare_frames(self, frames: Sequence[Frame], state: LayoutState) -> PreparedFrames:
        """One temporal patch: ``pixel_values [gh*gw*..., C*2*p*p]`` and ``grid_thw [1, 3]``.

        frames: one or two `Frame` (a lone frame is repeated to fill the patch; it counts as one sampled
            frame, as does the same Frame twice, which is how `temporal_groups` pads). The first step of a
            video fixes the resolution from its first frame (``state_update["frame_size"]``); later steps
            reuse it.
        """
        if not 1 <= len(frames) <= self.frames_per_step or not all(isinstance(f, Frame) for f in frames):
            raise InputError(f"{self.family} takes 1 or {self.frames_per_step} Frame objects per chunk, got "
                             f"{len(frames)} {', '.join(sorted({type(f).__name__ for f in frames}))}")
        size, update = self._frame_size(frames[0], state)
        pixel_values, grid_thw = self.pixel_values(frames, size)
        return PreparedFrames(frames=tuple(frames), pixel_values=pixel_values, grid_thw=grid_thw,
                              state_update=update)

    @torch.no_grad()
    def encode_vision(self, steps: Sequence[PreparedFrames]) -> list[VisualFeatures]:
        """Every step's temporal patch as one grid of the same vision-tower call (the tower attends within a
        grid only): visual tokens ``[n, D]`` and DeepStack features per step."""
        pixel_values = torch.cat([step.pixel_values for step in steps])
        grid_thw = torch.cat([step.grid_thw for step in steps])
        output = self.model.model.get_video_features(pixel_values.to(self.device), grid_thw.to(self.device))
        deepstack = list(zip(*output.deepstack_features)) or [()] * len(steps)  # per step: one tensor per layer
        return [VisualFeatures(embeds=embeds, deepstack=list(layers))
                for embeds, layers in zip(output.pooler_output, deepstack)]

    @torch.no_grad()
    def features_chunk(self, step: PreparedFrames, features: VisualFeatures, state: LayoutState) -> Chunk:
        """``<t seconds><|vision_start|>`` + n video pads + ``<|vision_end|>``, M-RoPE positions, DeepStack."""
        frames, embeds_in = step.frames, features.embeds
        seconds, origin = shown_seconds(frames, state)
        timestamp = (seconds[0] + seconds[-1]) / 2
        pads = torch.full((1, embeds_in.shape[0]), self.video_token_id, device=self.device)
        ids = torch.cat([self.tokenize(f"<{timestamp:.1f} seconds>"), self._id(self.vision_start_id), pads,
                         self._id(self.vision_end_id)], dim=1)
        slots = ids == self.video_token_id
        embeds = self.language_embeddings(ids)
        embeds = embeds.masked_scatter(slots.unsqueeze(-1), embeds_in.to(embeds.device, embeds.dtype))
        positions = self.rope_positions(ids, step.grid_thw.to(self.device), state)
        # temporal_groups pads a lone last frame by repeating the same Frame: it is one sampled frame
        sampled = 1 if frames[-1] is frames[0] else len(frames)
        return Chunk(input_ids=ids, inputs_embeds=embeds, position_ids=positions,
                     next_position=int(positions[1:].max()) + 1, frames=sampled,
                     forward_kwargs={"visual_pos_masks": slots, "deepstack_visual_embeds": features.deepstack},
                     state_update={**step.state_update, **origin})

    def question_ids(self, question: str, state: LayoutState) -> torch.Tensor:
        """The outer ``<|vision_end|>``, the question, the end of the user turn and the assistant opening."""
        if not isinstance(question, str) or not question.strip():
            raise InputError(f"the question must be a non-empty string, got {question!r}")
        return self.question_tokens(question, lambda text: self.question_open + text + self.question_close)

    def structure_tokens(self) -> tuple[str, ...]:
        """The video's markup."""
        return tuple(self.tokenizer.convert_ids_to_tokens([self.vision_start_id, self.video_token_id,
                                                           self.vision_end_id]))

    def prompt(self, prompt_ids: torch.Tensor, state: LayoutState) -> Prompt:
        """``prompt_ids [B, Q]`` at M-RoPE positions continuing from ``state.next_position``, decoded by the whole
        model; its ``rope_deltas``, which ``generate`` rewrites, are put back after (explicit positions keep the
        answer independent of them)."""
        positions = self.text_positions(state, prompt_ids.shape[1]).expand(-1, prompt_ids.shape[0], -1)
        return Prompt(prompt_ids, position_ids=positions, follows=state.tokens, model=self.model,
                      restores=((self.model.model, "rope_deltas"),))

    # -- preprocessing and model calls -----------------------------------------------------------------
    def pixel_values(self, frames: Sequence[Frame], size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Frames at ``size`` (height, width) -> ``pixel_values [t*gh*gw, 3*2*p*p]`` float32 and
        ``grid_thw [1, 3]``, as the checkpoint's video processor lays them out (see `qwen_pixel_values`)."""
        try:
            return qwen_pixel_values([frame.image for frame in frames], size, patch_size=self.settings.patch_size,
                                     merge_size=self.settings.merge_size,
                                     temporal_patch_size=self.settings.temporal_patch_size,
                                     mean=self.settings.image_mean, std=self.settings.image_std)
        except ValueError as error:
            raise InputError(f"cannot preprocess frame {frames[0].index}: {error}") from None

    def video_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The model's own video path: ``pixel_values [t*gh*gw, C*2*p*p]``, ``grid_thw [1, 3]`` ->
        (visual tokens ``[n, D]``, DeepStack features: one ``[n, D]`` per DeepStack layer), n = t*gh*gw / merge**2."""
        output = self.model.model.get_video_features(pixel_values.to(self.device), grid_thw.to(self.device))
        return torch.cat(output.pooler_output), [torch.cat(layer) for layer in output.deepstack_features]

    def rope_positions(self, ids: torch.Tensor, grid_thw: torch.Tensor, state: LayoutState) -> torch.Tensor:
        """Positions ``[4, 1, T]`` of a chunk ``ids [1, T]`` holding the video pads of ``grid_thw [1, 3]``:
        the sequence index, then ``get_rope_index`` of the chunk alone shifted to ``state.next_position``."""
        types = torch.where(ids == self.video_token_id, _VIDEO, _TEXT)
        mrope, _ = self.model.model.get_rope_index(ids, mm_token_type_ids=types, video_grid_thw=grid_thw)
        sequence = torch.arange(state.tokens, state.tokens + ids.shape[1], device=ids.device).view(1, 1, -1)
        return torch.cat([sequence, mrope + state.next_position])

    def text_positions(self, state: LayoutState, length: int) -> torch.Tensor:
        """Positions ``[4, 1, length]`` of text following ``state``: sequence index, then three equal rows."""
        sequence = torch.arange(state.tokens, state.tokens + length, device=self.device).view(1, 1, -1)
        mrope = torch.arange(state.next_position, state.next_position + length, device=self.device)
        mrope = mrope.view(1, 1, -1).expand(3, -1, -1)
        return torch.cat([sequence, mrope])

    # -- internals --------------------------------------------------------------------------------------
    def _frame_size(self, first: Frame, state: LayoutState) -> tuple[tuple[int, int], dict[str, Any]]:
        """The video's resolution: from the state, or chosen now from ``first`` (returned as a state update)."""
        if "frame_size" in state.extra:
            height, width = state.extra["frame_size"]
            return (int(height), int(width)), {}
        image = first.image
        if getattr(image, "ndim", 0) != 3 or image.shape[-1] != 3:
            raise InputError(f"frame {first.index} must be an RGB image [H, W, 3], got shape "
                             f"{list(getattr(image, 'shape', []))}")
        try:
            size = self.settings.frame_size(image.shape[0], image.shape[1], state.extra.get("num_frames"),
                                            self.tokens_per_frame)
        except ValueError as error:
            raise InputError(f"frame {first.index} cannot be resized for {self.family}: {error}") from None
        return size, {"frame_size": list(size)}

    def _split_chat_template(self, chat_template: str | None) -> tuple[str, str, str]:
        """The chat template's user turn with a video then the question, split into (prefix, the text between
        the video and the question, the text after the question)."""
        if not chat_template:
            raise UnsupportedModelError("this checkpoint has no chat template; cannot lay out a video prompt")
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": _QUESTION_SENTINEL}]}],
            chat_template=chat_template, tokenize=False, add_generation_prompt=True)
        start, pad, end = self.tokenizer.convert_ids_to_tokens([self.vision_start_id, self.video_token_id,
                                                                self.vision_end_id])
        before, found, after = rendered.partition(pad)
        question_open, sentinel, question_close = after.partition(_QUESTION_SENTINEL)
        if (not found or pad in after or not before.endswith(start) or not after.startswith(end)
                or not sentinel):
            raise UnsupportedModelError(f"the chat template does not write a video as {start}{pad}{end} "
                                        "followed by the question")
        return before, question_open, question_close

    def _id(self, token_id: int) -> torch.Tensor:
        return torch.tensor([[token_id]], device=self.device)

    def _count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_frame_count(num_frames: int | None, *, allow_none: bool) -> None:
    if not (_positive_int(num_frames) or (num_frames is None and allow_none)):
        raise InputError(f"num_frames must be a positive integer, got {num_frames!r}")
