"""Eagle2.5 and the original InternVL3 release: checkpoints whose modelling code ships with them.

Both load only with ``trust_remote_code=True`` and expose one interface: ``extract_feature(pixel_values)``
(vision tower + pixel shuffle + projector, ``[N, 3, S, S] -> [N, num_image_token, D]``), ``language_model`` (a
transformers causal LM, Qwen2), ``num_image_token``, ``config.force_image_size`` / ``vision_config.image_size``
and a ``template`` name for their own conversation code. The visual tokens are ``<IMG_CONTEXT>`` slots inside
``<img>…</img>``, exactly as in transformers' native InternVL, so this adapter reuses `InternVLAdapter`'s
chunking and only changes how the model is reached and how prompts are laid out.

Model types: ``eagle_2_5_vl`` (Eagle2.5, and the test stand-in `statekv.testing.TinyEagleForConditionalGeneration`)
and ``internvl_chat`` (InternVL3 before the ``-hf`` conversion).

Layouts (each frame is one chunk; the user turn comes from the tokenizer's chat template):

``eagle`` (default for Eagle; what Eagle2.5's processor makes of a video item)
    ``The first video sampled with {fps:.2f} fps: `` (``The first video: `` when the rate is unknown), then per
    frame ``Frame {i} sample at {t:.2f}s: <img>…</img>`` (``i`` from 1, ``t`` the frame's time in seconds, as
    `shown_seconds` shows it), frames joined with nothing, the question right after the last
    ``</img>``.
``paper`` (default for internvl_chat; reproduces the paper)
    ``<img>…</img>\\n`` per frame before the chat-templated question, as `InternVLAdapter`.
``chat`` (InternVL's ``chat()`` video prompt)
    ``Frame{i}: <img>…</img>`` lines joined by ``\\n`` at the start of the user turn, ``\\n`` and the question.

Chunk boundaries sit next to special tokens or where the tokenizer's pre-tokenizer splits anyway: the
``eagle`` prefix chunk ends at ``fps:`` and the first frame chunk starts with the space of `` Frame 1``, which
byte-level BPE attaches to the following word. So tokenizing chunk by chunk gives the ids of the whole prompt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModel, AutoTokenizer

from ..core.answering.decoding import Prompt

from ..errors import InputError, UnsupportedModelError
from ..settings.values import check_int, check_number
from ..video import IMAGENET_MEAN, IMAGENET_STD
from .base import Chunk, LayoutState
from .checkpoint_files import normalisation, processor_chat_template, square_side
from .internvl import InternVLAdapter
from .registry import register_adapter

_VIDEO_SENTINEL = "\x00statekv-video\x00"
_SIGLIP_NORMALISATION = (0.5, 0.5, 0.5)  # mean = std for SigLIP vision towers
# The widest texts max_video_tokens allows for: timestamps up to 11 days, sampling rates up to 1000 fps.
_WIDEST_TIMESTAMP = 999_999.99
_WIDEST_FPS = 999.99


@register_adapter
class RemoteInternVLAdapter(InternVLAdapter):
    """Remote-code Eagle2.5 / InternVL3 checkpoints; see the module docstring for the layouts."""

    family = "remote_internvl"
    model_types = ("eagle_2_5_vl", "internvl_chat")
    eagle_model_types = ("eagle_2_5_vl",)  # SigLIP tower, the eagle layout by default
    layouts = ("eagle", "paper", "chat")
    needs_remote_code = True
    context_image_token = "<IMG_CONTEXT>"

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, layout: str | None = None,
                 image_size: int = 448, image_mean: Sequence[float] = IMAGENET_MEAN,
                 image_std: Sequence[float] = IMAGENET_STD, chat_template: str | None = None):
        model_type = model.config.model_type
        super().__init__(model, tokenizer, layout=layout or self.default_layout(model_type),
                         image_size=image_size, image_mean=image_mean, image_std=image_std)
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            name = getattr(model, "template", None) or getattr(model.config, "template", None)
            raise InputError(f"this {model_type} checkpoint has no chat template (its remote code formats prompts "
                             f"with its own {name!r} conversation template); add a chat_template to its tokenizer")

    @property
    def shows_times(self) -> bool:
        return self.layout == "eagle"

    @classmethod
    def default_layout(cls, model_type: str) -> str:
        """``eagle`` for Eagle checkpoints, ``paper`` for the InternVL3 release."""
        return "eagle" if model_type in cls.eagle_model_types else "paper"

    @classmethod
    def from_pretrained(cls, path: str | Path, *, layout: str | None = None, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None, trust_remote_code: bool = False,
                        **model_kwargs: Any) -> "RemoteInternVLAdapter":
        if not trust_remote_code:
            raise UnsupportedModelError(f"{path} ships its own modelling code ({cls.family}); pass "
                                        "trust_remote_code=True (--trust-remote-code) if you trust it")
        if layout is not None:
            cls.check_layout(layout)
        try:
            model = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=dtype or "auto", **model_kwargs)
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
            chat_template = tokenizer.chat_template or processor_chat_template(path)
        except (OSError, json.JSONDecodeError) as error:
            raise InputError(f"cannot load {path}: {str(error).splitlines()[0]}") from None
        if model.config.model_type not in cls.model_types:
            raise UnsupportedModelError(f"{path} is a {model.config.model_type!r} checkpoint, not {cls.family}")
        if device is not None:
            model = model.to(device)
        config = model.config
        eagle = config.model_type in cls.eagle_model_types  # SigLIP tower: 0.5 / 0.5 unless the checkpoint says
        mean, std = normalisation(path, default=(_SIGLIP_NORMALISATION,) * 2 if eagle else (IMAGENET_MEAN, IMAGENET_STD))
        image_size = square_side(getattr(config, "force_image_size", None) or config.vision_config.image_size)
        return cls(model, tokenizer, layout=layout, image_size=image_size, image_mean=mean, image_std=std,
                   chat_template=chat_template)

    # -- the remote-code interface ----------------------------------------------------------------------
    @property
    def tokens_per_image(self) -> int:
        return int(self.model.num_image_token)

    @property
    def language_embeddings(self) -> torch.nn.Embedding:
        return self.model.language_model.get_input_embeddings()

    @property
    def decoder(self) -> torch.nn.Module:
        return self.model.language_model

    def _image_token_id(self) -> int:
        """The tokenizer's ``<IMG_CONTEXT>`` id, checked against the model's; set on the model when it has none
        yet, as the remote ``chat()`` does before it calls ``generate()``."""
        token_id = self.tokenizer.convert_tokens_to_ids(self.context_image_token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            raise UnsupportedModelError(f"the tokenizer of this checkpoint has no {self.context_image_token} token")
        declared = {"img_context_token_id": getattr(self.model, "img_context_token_id", None),
                    "config.image_token_index": getattr(self.model.config, "image_token_index", None),
                    "config.image_token_id": getattr(self.model.config, "image_token_id", None)}
        for name, value in declared.items():
            if value is not None and int(value) != token_id:
                raise UnsupportedModelError(f"the model's {name} is {value} but the tokenizer's "
                                            f"{self.context_image_token} is {token_id}")
        if declared["img_context_token_id"] is None:
            self.model.img_context_token_id = token_id
        return int(token_id)

    @torch.no_grad()
    def visual_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values [N, 3, S, S]`` -> visual tokens ``[N, tokens_per_image, D]`` (``extract_feature``)."""
        vision = getattr(self.model, "vision_model", None)
        dtype = next(vision.parameters()).dtype if vision is not None else self.dtype
        return self.model.extract_feature(pixel_values.to(self.device, dtype))

    # -- layout -----------------------------------------------------------------------------------------
    def start(self, num_frames: int | None = None, fps: float | None = None) -> LayoutState:
        """``fps``: the rate frames were sampled at, stated by the ``eagle`` layout's prefix (None: unknown).
        Eagle's processor states the effective rate, sampled frames / video frames * video fps."""
        if num_frames is not None:
            check_int(num_frames, "num_frames", error=InputError)
        if fps is not None:
            check_number(fps, "fps", error=InputError)
        return LayoutState(extra={"fps": None if fps is None else float(fps)})

    def prefix(self, state: LayoutState) -> Chunk | None:
        text = self._prefix_text(state.extra.get("fps"))
        return self.text_chunk(text, state) if text else None

    def frame_text(self, index: int, timestamp: float) -> str:
        if self.layout != "eagle":
            return super().frame_text(index, timestamp)
        lead = " " if index == 0 else ""  # the space after the prefix's "fps:" goes with "Frame", as BPE splits it
        return f"{lead}Frame {index + 1} sample at {timestamp:.2f}s: {self.image_block}"

    def max_video_tokens(self, num_frames: int, *, frame_size: tuple[int, int] | None = None) -> int:
        """The prefix (at the widest sampling rate) plus, per frame, the UTF-8 bytes of its text (a byte-level
        tokenizer never needs more tokens) around the ``<img>…</img>`` block, at the widest timestamp."""
        check_int(num_frames, "num_frames", error=InputError)
        text = self.frame_text(num_frames - 1, _WIDEST_TIMESTAMP).replace(self.image_block, "")
        per_frame = len(text.encode()) + 1 + self.tokens_per_image + 2  # +1: the first eagle frame's space
        return self.count_tokens(self._prefix_text(_WIDEST_FPS) or "") + num_frames * per_frame

    def question_ids(self, question: str, state: LayoutState) -> torch.Tensor:
        if self.layout == "paper":
            return self.question_tokens(question, self._render_user_turn)
        return self.question_tokens(question, lambda text: self._chat_turn_around_video(text)[1])

    def prompt(self, prompt_ids: torch.Tensor, state: LayoutState) -> Prompt:
        """Decoded by the language model itself: the remote ``generate`` embeds its own prompt and takes no cache."""
        return Prompt(prompt_ids, follows=state.tokens, model=self.decoder)

    # -- internals --------------------------------------------------------------------------------------
    def _prefix_text(self, fps: float | None = None) -> str | None:
        if self.layout == "paper":
            return None
        before = self._chat_turn_around_video("")[0]
        if self.layout == "chat":
            return before
        rate = "" if fps is None else f" sampled with {fps:.2f} fps"
        return f"{before}The first video{rate}:"

    def _chat_turn_around_video(self, question: str) -> tuple[str, str]:
        """The chat-templated user turn (video, then question) split at the video: (before, after).

        The video goes in as a placeholder inside string content, which every chat template renders (some
        remote checkpoints' templates concatenate ``message['content']`` and cannot take content lists).
        """
        separator = "\n" if self.layout == "chat" else ""
        before, found, after = self._render_user_turn(_VIDEO_SENTINEL + separator + question).partition(
            _VIDEO_SENTINEL)
        if not found:
            raise InputError("the chat template of this checkpoint drops the user's message text; "
                             "it cannot be used for video prompts")
        return before, after

    def _render_user_turn(self, content: str) -> str:
        """One user message, rendered by the chat template with the assistant's turn opened."""
        return self.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                  chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)
