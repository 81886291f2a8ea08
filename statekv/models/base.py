"""The contract between a model family and the streaming pipeline.

An adapter turns a video into the chunks `StreamingPrefill` steps through, and a question into the prompt
that is decoded after them. It owns everything family-specific: the prompt layout, the vision encoder call,
RoPE positions and what generation needs (`prompt`). The pipeline owns everything else (sampling, carry policy, timing).

A video is streamed as::

    state = adapter.start(num_frames)                # LayoutState: where the prompt stands
    chunk = adapter.prefix(state)                     # text before the first frame, or None
    for frames in groups of adapter.frames_per_step:
        chunk = adapter.frames_chunk(frames, state)   # one step: vision-encode these frames now, embed
        prefill.step(chunk.inputs_embeds, chunk.position_ids, **chunk.forward_kwargs)
        state = state.after(chunk)

`frames_chunk` is three calls that the overlapped pipeline (`statekv.steps.overlap`) runs on three threads, so the
vision tower sees batches of steps while the language model streams one step at a time::

    step = adapter.prepare_frames(frames, state)      # CPU only (resize, normalise): PreparedFrames
    features = adapter.encode_vision([step, ...])     # one vision-tower call for several steps
    chunk = adapter.features_chunk(step, features[0], state)   # token ids, embeddings, positions
    ids = adapter.question_ids(question, state)       # what follows the video, [1, Q]
    prompt = adapter.prompt(ids, state)                # what generation needs: ids, positions, the decoding model
    new_tokens = prefill.generate(prompt, max_new_tokens=...)   # the engine checks and generates

Every method is a pure function of its arguments and the (frozen) model, so one adapter serves any number
of videos and streams at once, and a `LayoutState` is all that must be saved to resume a stream.
"""

from __future__ import annotations

import functools
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..core.answering.decoding import Prompt
from ..errors import InputError
from ..video import Frame


@dataclass
class Chunk:
    """One streaming step.

    input_ids: LongTensor ``[1, T]``: the chunk's token ids, with the family's placeholder id at each visual
        token (what the model's own processor would have produced for this span of the prompt).
    inputs_embeds: ``[1, T, D]`` in the language model's dtype and device, visual features already in place.
    position_ids: ``[1, T]`` for 1-D RoPE, ``[3 or 4, 1, T]`` for M-RoPE; ``None`` continues from the
        stream's length.
    next_position: the first RoPE position after this chunk (equals the token count for 1-D RoPE).
    frames: how many sampled frames the chunk holds (0 for text).
    forward_kwargs: extra keyword arguments for the decoder's forward (e.g. DeepStack features).
    state_update: family-specific `LayoutState.extra` fields this chunk fixes (e.g. the frame resolution
        chosen at the first frame), merged into the state by `LayoutState.after`.
    """

    input_ids: torch.Tensor
    inputs_embeds: torch.Tensor
    position_ids: torch.Tensor | None
    next_position: int
    frames: int = 0
    forward_kwargs: dict[str, Any] = field(default_factory=dict)
    state_update: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[-1]


@dataclass
class PreparedFrames:
    """One step's frames, preprocessed on the CPU and ready for the vision tower (no model call made yet).

    frames: the step's `Frame` objects (1 to ``frames_per_step``, in time order).
    pixel_values: float32 CPU tensor in the family's layout (InternVL: ``[F, 3, S, S]``; Qwen3-VL:
        ``[patches, C * 2 * p * p]``, one temporal patch).
    grid_thw: LongTensor ``[1, 3]`` for families whose vision tower takes a patch grid (Qwen3-VL), else None.
    state_update: `LayoutState.extra` fields this step fixes (e.g. Qwen3-VL's resolution at the first frame).
    """

    frames: tuple[Frame, ...]
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor | None = None
    state_update: dict[str, Any] = field(default_factory=dict)


@dataclass
class VisualFeatures:
    """The vision tower's output for one step, on the model's device.

    embeds: ``[n, D]``: the step's n visual tokens, in prompt order (vision tower + projector).
    deepstack: one ``[n, D]`` per DeepStack layer (Qwen3-VL), else empty.
    """

    embeds: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class LayoutState:
    """Where one video's prompt stands after the chunks streamed so far (small and JSON-serialisable).

    frames: sampled frames encoded. tokens: tokens streamed. next_position: next RoPE position (differs from
    ``tokens`` under M-RoPE, where a frame's tokens share temporal positions). extra: family-specific fields.
    """

    frames: int = 0
    tokens: int = 0
    next_position: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def after(self, chunk: Chunk) -> "LayoutState":
        """The state once ``chunk`` has been streamed."""
        return replace(self, frames=self.frames + chunk.frames, tokens=self.tokens + chunk.num_tokens,
                       next_position=chunk.next_position, extra={**self.extra, **chunk.state_update})

    def updated(self, extra: dict[str, Any]) -> "LayoutState":
        """This state with ``extra`` merged in (what `prepare_frames` needs of a step not yet streamed)."""
        return replace(self, extra={**self.extra, **extra}) if extra else self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LayoutState":
        return cls(**data)


QUESTION_SLOT = "\x00statekv-question-slot\x00"  # where `VideoAdapter.question_tokens` finds a prompt's question
TIME_ORIGIN = "time_origin"  # `LayoutState.extra`: the time a prompt counts its video's seconds from, unless 0
OTHER_CLOCK = 1e6  # seconds: a first frame timed this late was timed by another clock than the video's own


def shown_seconds(frames: Sequence[Frame], state: LayoutState) -> tuple[list[float], dict[str, Any]]:
    """The seconds a prompt shows for a step's ``frames`` streamed after ``state``, and what the step fixes of
    `LayoutState.extra`. A video's frames show their own times, seconds since it began (a file's sampled frames, a
    stream's pushes), as the model's processor shows a video's; a stream whose first frame is timed at `OTHER_CLOCK`
    or later (an epoch's wall clock, a camera's uptime: past the longest time a prompt's token bound allows for)
    counts from that first frame, its time kept as the origin at its step. A state holding frames but no origin
    counts from 0, as a stream saved before the origin was kept did."""
    first = frames[0].timestamp if state.frames == 0 else 0.0
    origin = state.extra.get(TIME_ORIGIN, first if first >= OTHER_CLOCK else 0.0)
    fixed = {TIME_ORIGIN: origin} if state.frames == 0 and origin else {}
    return [frame.timestamp - origin for frame in frames], fixed


class VideoAdapter(ABC):
    """One model family: prompt layout, per-chunk vision encoding, positions and decoding.

    Class attributes a subclass sets:
        family: short name shown to users (``"internvl"``).
        model_types: the ``config.model_type`` values it serves (the registry key).
        layouts: prompt layouts it offers; the first is the default.
        frames_per_step: sampled frames per streaming step (2 for Qwen3-VL's temporal patches).
        needs_remote_code: the checkpoints load only with ``trust_remote_code=True``.
    """

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    layouts: ClassVar[tuple[str, ...]] = ("default",)
    frames_per_step: ClassVar[int] = 1
    needs_remote_code: ClassVar[bool] = False

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, layout: str | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.layout = self.check_layout(layout)

    @classmethod
    def check_layout(cls, layout: str | None) -> str:
        if layout is None:
            return cls.layouts[0]
        if layout not in cls.layouts:
            raise InputError(f"{cls.family} has no prompt layout {layout!r}; choose one of {', '.join(cls.layouts)}")
        return layout

    @classmethod
    @abstractmethod
    def from_pretrained(cls, path: str | Path, *, layout: str | None = None, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None, trust_remote_code: bool = False,
                        **model_kwargs: Any) -> "VideoAdapter":
        """Load the model, tokenizer and preprocessing settings from a checkpoint folder or hub id."""

    # -- planning ---------------------------------------------------------------------------------------
    @abstractmethod
    def max_video_tokens(self, num_frames: int, *, frame_size: tuple[int, int] | None = None) -> int:
        """An upper bound on the tokens that ``num_frames`` sampled frames (prefix included) stream.

        frame_size: the source's (height, width), when known, for families whose token count depends on it.
        """

    def min_video_tokens(self, num_frames: int, *, frame_size: tuple[int, int] | None = None) -> int:
        """A lower bound on the tokens that ``num_frames`` sampled frames (prefix included) stream (with
        `max_video_tokens`, what bounds the room a horizon leaves after the video): at least one a step here;
        families count their visual tokens."""
        return math.ceil(num_frames / self.frames_per_step)

    # -- streaming --------------------------------------------------------------------------------------
    def start(self, num_frames: int | None = None, fps: float | None = None) -> LayoutState:
        """The state before anything of a video has been streamed.

        num_frames: how many sampled frames the video will have (``None`` for an open-ended live stream).
        fps: the sampling rate (frames per second of video time), for layouts that state it.
        """
        return LayoutState()

    @abstractmethod
    def prefix(self, state: LayoutState) -> Chunk | None:
        """The text chunk streamed before the first frame (system prompt, user turn opening...), or None."""

    @torch.no_grad()
    def frames_chunk(self, frames: Sequence[Frame], state: LayoutState) -> Chunk:
        """Vision-encode ``frames`` (at most ``frames_per_step``, in time order) and lay them out as one chunk."""
        step = self.prepare_frames(frames, state)
        return self.features_chunk(step, self.encode_vision([step])[0], state)

    @abstractmethod
    def prepare_frames(self, frames: Sequence[Frame], state: LayoutState) -> PreparedFrames:
        """Preprocess one step's ``frames`` on the CPU (no model call, safe on any thread).

        Only ``state.extra`` is read (what earlier steps fixed), so it can run ahead of the language model.
        """

    @abstractmethod
    def encode_vision(self, steps: Sequence[PreparedFrames]) -> list[VisualFeatures]:
        """Run the vision tower (and projector) once over every step of ``steps``; one result per step.

        Gives the features of one call per step (steps never attend to each other), up to float rounding.
        """

    @abstractmethod
    def features_chunk(self, step: PreparedFrames, features: VisualFeatures, state: LayoutState) -> Chunk:
        """Lay ``step`` out as the chunk that follows ``state``, its visual tokens taken from ``features``."""

    @abstractmethod
    def question_ids(self, question: str, state: LayoutState) -> torch.Tensor:
        """The prompt that follows the streamed video: LongTensor ``[1, Q]`` on the model's device."""

    def prompt(self, prompt_ids: torch.Tensor, state: LayoutState) -> Prompt:
        """What generation needs of ``prompt_ids [B, Q]`` after the video streamed to ``state``: the ids, their
        positions (None: they continue from the stream's length), the module that decodes (None: the model) and
        the stream length they follow; `StreamingPrefill.generate` checks it and decodes."""
        return Prompt(prompt_ids, follows=state.tokens)

    def decode(self, new_tokens: torch.Tensor) -> str:
        """New tokens ``[1, N]`` -> answer text (special tokens dropped, whitespace stripped)."""
        return self.tokenizer.decode(new_tokens[0], skip_special_tokens=True).strip()

    # -- helpers ----------------------------------------------------------------------------------------
    def structure_tokens(self) -> tuple[str, ...]:
        """The tokens this adapter writes into a prompt besides the tokenizer's special ones (its visual markup)."""
        return ()

    def question_tokens(self, question: str, render: Callable[[str], str]) -> torch.Tensor:
        """The prompt ``render(question)`` -> LongTensor ``[1, Q]`` on the model's device, the user's question read
        as text: where it holds a control token's text (a special token's, as ``<|im_end|>``, or one of
        `structure_tokens`, as ``<IMG_CONTEXT>``), the text between the prompt's own control tokens around it is
        tokenized without the tokenizer's added tokens, so a question never writes the model's structure. A question
        without one is tokenized as the whole prompt."""
        controls = self._control_tokens
        if controls.search(question) is None:
            return self.tokenize(render(question))
        before, found, after = render(QUESTION_SLOT).partition(QUESTION_SLOT)
        if not found:
            raise InputError(f"the question holds a control token of this model ({controls.search(question)[0]!r}) "
                             "and its prompt layout cannot read it as text; rephrase it without")
        head = max((match.end() for match in controls.finditer(before)), default=0)
        first = controls.search(after)
        tail = first.start() if first else len(after)
        return torch.cat([self.tokenize(before[:head]), self._text_ids(before[head:] + question + after[:tail]),
                          self.tokenize(after[tail:])], dim=1)

    @functools.cached_property
    def _control_tokens(self) -> re.Pattern:
        """A pattern matching the text of every control token (longest first: a token before those it holds)."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}).values()
        tokens = {token.content for token in added if token.special} | set(self.structure_tokens())
        tokens = sorted((token for token in tokens if token.strip()), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, tokens)) or "(?!)")

    def _text_ids(self, text: str) -> torch.Tensor:
        """``text`` tokenized as plain text, none of the tokenizer's added tokens matched: ``[1, T]``."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
        else:  # split_special_tokens would still match the added tokens that are not special
            text = backend.normalizer.normalize_str(text) if backend.normalizer else text
            pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer else [(text, None)]
            ids = [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    @property
    def device(self) -> torch.device:
        return self.language_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.language_embeddings.weight.dtype

    @property
    def language_embeddings(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def decoder(self) -> torch.nn.Module:
        """The module that decodes an answer (`prompt`'s ``model``): its generation config names the end tokens."""
        return self.model

    def tokenize(self, text: str) -> torch.Tensor:
        """Text -> LongTensor ``[1, T]`` on the model's device (no BOS or other added tokens)."""
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        return ids.to(self.device)

    def text_chunk(self, text: str, state: LayoutState) -> Chunk:
        """A chunk of plain text at 1-D positions continuing from ``state``."""
        ids = self.tokenize(text)
        return Chunk(input_ids=ids, inputs_embeds=self.language_embeddings(ids), position_ids=None,
                     next_position=state.next_position + ids.shape[1])
