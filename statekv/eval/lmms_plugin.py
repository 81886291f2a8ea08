"""lmms-eval plugin: ``lmms-eval --model statekv --model_args pretrained=...,method=statekv,budget=4096``.

statekv registers itself in lmms-eval's entry-point group ``lmms_eval.models`` (see `manifest`) as the chat
model ``statekv``. Model args (``--model_args key=value,...``)::

    pretrained       checkpoint folder or hub id (required)
    method           statekv | full | recency                       (default statekv)
    budget           StateKV budget B in tokens                     (default 4096)
    frames           recency window R in frames                     (default 16)
    max_num_frames   at most this many frames per video             (default 512)
    max_fps          at most this many frames per second            (default 1)
    layout           the family's prompt layout                     (default: the paper's)
    attention        auto | eager | chunked | triton                (default auto)
    dtype, device, trust_remote_code, offload                       as `statekv.VideoQA.from_pretrained`

A request is lmms-eval 0.7's chat request: ``Instance.args = (context, doc_to_messages, gen_kwargs, doc_id,
task, split)``, where ``doc_to_messages(task_dict[task][split][doc_id])`` gives the chat messages: one
user turn holding one video (``{"type": "video", "url": path}``) and the prompt text. Requests about the same
video are answered from one encoding. ``gen_kwargs`` give ``max_new_tokens``, ``until`` (stop strings) and
``temperature`` (0: greedy). Under ``accelerate launch`` each process places its model on
``cuda:<LOCAL_RANK>``; lmms-eval itself splits the documents and gathers the answers.

lmms-eval is optional: without it this module still imports (the class then has a stand-in base with the
same request contract), so the request handling is usable and testable on its own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from statekv.core.errors import InputError
from statekv.eval.answering import room_for_prompts

logger = logging.getLogger(__name__)

MODEL_ID = "statekv"
DEFAULT_MAX_NEW_TOKENS = 1024  # lmms-eval's chat models' default when a task sets none


def manifest():
    """The entry point's payload: the ``statekv`` chat model for lmms-eval's registry."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, chat_class_path=f"{__name__}.StateKV")


try:
    from lmms_eval.api.model import lmms as _Base

    LMMS_EVAL_AVAILABLE = True
except ImportError:  # the optional dependency is absent: keep the same contract without it
    LMMS_EVAL_AVAILABLE = False

    class _Base:  # type: ignore[no-redef]
        """What `StateKV` uses of ``lmms_eval.api.model.lmms``."""

        is_simple = True

        def __init__(self) -> None:
            self._rank, self._world_size = 0, 1
            self.task_dict: dict[str, Any] = {}
            self.cache_hook = None

        @property
        def rank(self) -> int:
            return self._rank

        @property
        def world_size(self) -> int:
            return self._world_size


class StateKV(_Base):
    """A statekv `VideoQA` as an lmms-eval chat model (see the module docstring)."""

    is_simple = False

    def __init__(self, pretrained: str, method: str = "statekv", budget: int = 4096, frames: int = 16,
                 max_num_frames: int = 512, max_fps: float = 1.0, layout: str | None = None, attention: str = "auto",
                 dtype: str | None = None, device: str | None = None, trust_remote_code: bool = False,
                 offload: bool = False, batch_size: int | str = 1, qa=None, **unused: Any) -> None:
        super().__init__()
        from statekv.pipeline import VideoQA

        if int(batch_size) != 1:
            raise InputError(f"the statekv model answers one request at a time; use batch_size=1, not {batch_size}")
        for name in unused:
            if name != "max_batch_size":
                logger.warning("statekv: ignoring unknown model arg %r", name)
        self.max_num_frames = int(max_num_frames)
        self.max_fps = float(max_fps)
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        self._rank, self._world_size = int(os.environ.get("RANK", 0)), world_size
        self.qa = qa if qa is not None else VideoQA.from_pretrained(
            pretrained, method=method, budget=int(budget), frames=int(frames), layout=_none(layout),
            attention=attention, dtype=_none(dtype), device=_device(device, world_size),
            trust_remote_code=bool(trust_remote_code), offload=bool(offload),
        )

    # -- lmms-eval's request entry points ---------------------------------------------------------------
    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        """Answer chat requests, in their order; requests about one video share one encoding."""
        from tqdm.auto import tqdm

        prepared = [self._prepare(request) for request in requests]
        answers: list[str | None] = [None] * len(prepared)
        by_video: dict[str, list[int]] = {}
        for index, (video, _, _) in enumerate(prepared):
            by_video.setdefault(video, []).append(index)
        with tqdm(total=len(prepared), disable=self.rank != 0, desc="statekv answering") as bar:
            for video, indices in by_video.items():
                prompts = [prepared[index][1] for index in indices]
                longest_answer = max(_max_new_tokens(prepared[index][2]) for index in indices)
                with room_for_prompts(self.qa, prompts, longest_answer):
                    encoded = self.qa.encode(video, max_fps=self.max_fps, max_frames=self.max_num_frames)
                with encoded:
                    for index in indices:
                        _, prompt, gen_kwargs = prepared[index]
                        answers[index] = self._answer(encoded, prompt, gen_kwargs)
                        if self.cache_hook is not None:
                            self.cache_hook.add_partial("generate_until", (requests[index].args[0], gen_kwargs),
                                                        answers[index])
                        bar.update(1)
        return answers  # type: ignore[return-value]

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        raise NotImplementedError("the statekv model generates answers; it does not score log-likelihoods")

    def generate_until_multi_round(self, requests: Sequence[Any]) -> list[str]:
        raise NotImplementedError("the statekv model answers single-turn requests only")

    # -- internals --------------------------------------------------------------------------------------
    def _prepare(self, request: Any) -> tuple[str, str, dict[str, Any]]:
        """``(video path, prompt text, generation kwargs)`` of one chat request."""
        try:
            _, doc_to_messages, gen_kwargs, doc_id, task, split = request.args
        except (TypeError, ValueError):
            raise InputError("expected a chat request: args = (context, doc_to_messages, gen_kwargs, doc_id, task, "
                             "split); is the model registered as a chat model?") from None
        messages = doc_to_messages(self.task_dict[task][split][doc_id])
        return (*video_and_prompt(messages, where=f"{task} doc {doc_id}"), dict(gen_kwargs or {}))

    def _answer(self, encoded, prompt: str, gen_kwargs: dict[str, Any]) -> str:
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else [stop for stop in until if stop]
        options: dict[str, Any] = {"max_new_tokens": _max_new_tokens(gen_kwargs)}
        temperature = float(gen_kwargs.get("temperature") or 0)
        if temperature > 0:
            options.update(do_sample=True, temperature=temperature)
            if gen_kwargs.get("top_p") is not None:
                options["top_p"] = float(gen_kwargs["top_p"])
        if until:
            options.update(stop_strings=until, tokenizer=self.qa.adapter.tokenizer)
        text = encoded.ask(prompt, **options)
        for stop in until:  # generate() keeps the stop string; lmms-eval's answers end before it
            text = text.split(stop)[0]
        return text


def video_and_prompt(messages: Any, *, where: str = "request") -> tuple[str, str]:
    """The one video path and the prompt text of lmms-eval chat ``messages`` (dicts or ``ChatMessages``).

    System turns are not part of the benchmarks' prompts and are ignored; the user turn's text items are
    joined in order.
    """
    if hasattr(messages, "model_dump"):
        messages = messages.model_dump()["messages"]
    if isinstance(messages, dict) and "messages" in messages:
        messages = messages["messages"]
    videos, texts = [], []
    for message in messages:
        if message.get("role") != "user":
            continue
        for item in message.get("content", []):
            kind = item.get("type")
            if kind == "video":
                videos.append(item.get("url"))
            elif kind == "text":
                texts.append(item.get("text", ""))
            else:
                raise InputError(f"{where}: the statekv model takes one video and text, not {kind!r} content")
    if len(videos) != 1 or not isinstance(videos[0], (str, os.PathLike)):
        raise InputError(f"{where}: expected exactly one video given as a file path, got {videos!r}")
    prompt = "".join(texts)
    if not prompt.strip():
        raise InputError(f"{where}: the request has no question text")
    return os.fspath(videos[0]), prompt


def _max_new_tokens(gen_kwargs: dict[str, Any]) -> int:
    return int(gen_kwargs.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)


def _none(value: Any) -> Any:
    return None if value in (None, "", "None", "none") else value


def _device(device: str | None, world_size: int) -> str | None:
    """The model's device: this process's GPU under a multi-process launch, else the requested one."""
    import torch

    device = _none(device)
    if world_size > 1 and torch.cuda.is_available() and (device is None or str(device) == "cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return device
