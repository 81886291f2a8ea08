"""What ``statekv demo`` measures: accuracy of each method on held-out synthetic videos, and what each frame
attends to and costs as one stream grows; and the demo's plot."""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Z95 = 1.959964  # two-sided 95% normal quantile
SMOOTHING = 31  # frames in the plot's running median of the time per frame


@dataclass
class Scored:
    """One method's answers to the held-out questions."""

    method: str
    label: str
    answers: list[dict[str, Any]] = field(default_factory=list)  # {"qid", "family", "answer", "correct"}
    seconds: float = 0.0

    @property
    def correct(self) -> int:
        return sum(answer["correct"] for answer in self.answers)

    def family(self, name: str) -> tuple[int, int]:
        """(correct, asked) for one question family."""
        mine = [answer for answer in self.answers if answer["family"] == name]
        return sum(answer["correct"] for answer in mine), len(mine)


def wilson(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (as fractions)."""
    if total == 0:
        return 0.0, 1.0
    share = correct / total
    middle = (share + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(share * (1 - share) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, middle - half), min(1.0, middle + half)


def score(qa: Any, method: str, label: str, videos: list[tuple[Path, list[dict]]], *, max_new_tokens: int,
          together: int = 1) -> Scored:
    """Stream each video (one frame per second) under ``qa`` and answer its questions (rows of a synthetic question
    file). ``together`` videos at a time are pushed as streams stepped together (`VideoQA.push_many`) and their
    questions asked together (`VideoQA.ask_many`): each answer is the one its video gets alone."""
    from statekv.eval.parsing import ranked_letter
    from statekv.synthetic.prompts import question_prompt
    from statekv.video import open_video

    scored, started = Scored(method, label), time.perf_counter()
    for first in range(0, len(videos), together):
        group = videos[first:first + together]
        sources = [open_video(video) for video, _ in group]
        streams = []
        try:
            for (video, _), source in zip(group, sources):
                frames = len(source.sample_indices(max_fps=1.0, max_frames=10**6))
                streams.append(qa.stream(frames, max_fps=1.0, name=video.name))
            shown = [source.sample(max_fps=1.0, max_frames=10**6) for source in sources]
            for frames in itertools.zip_longest(*shown):
                qa.push_many([(stream, frame.image, frame.timestamp)
                              for stream, frame in zip(streams, frames) if frame is not None])
            rows = [(stream, row) for stream, (_, questions) in zip(streams, group) for row in questions]
            answers = qa.ask_many([(stream, question_prompt(row["question"], row["options"]),
                                    {"max_new_tokens": max_new_tokens}) for stream, row in rows])
        finally:
            for stream in streams:
                stream.close()
        scored.answers.extend({"qid": row["qid"], "family": row["task_type"], "answer": answer,
                               "correct": ranked_letter(answer) == row["answer"]}
                              for (_, row), answer in zip(rows, answers, strict=True))
    scored.seconds = time.perf_counter() - started
    return scored


@dataclass
class Growth:
    """One stream fed frame after frame: per frame, the tokens seen, the carried state, the wall time."""

    method: str
    label: str
    tokens: list[int] = field(default_factory=list)
    carried: list[int] = field(default_factory=list)
    frame_ms: list[float] = field(default_factory=list)
    token_bytes: int = 0  # keys and values of one token over every layer

    def window(self, start: int, end: int) -> dict[str, float]:
        """Frames ``start`` to ``end`` (0-based, end excluded): median ms per frame, the carried state (tokens
        and KiB) a frame attends to at the window's end, tokens seen then."""
        last = min(end, len(self.tokens)) - 1
        return {"ms_per_frame": statistics.median(self.frame_ms[start:end]), "carried": self.carried[last],
                "carried_kib": self.carried[last] * self.token_bytes / 1024, "tokens": self.tokens[last]}


def grow(qa: Any, method: str, label: str, videos: list[Path]) -> Growth:
    """Feed ``videos`` back to back into one stream (one frame per second) and note each frame's cost."""
    from statekv.video import open_video

    sources = [open_video(video) for video in videos]
    frames = sum(len(source.sample_indices(max_fps=1.0, max_frames=10**6)) for source in sources)
    growth = Growth(method, label, token_bytes=_token_bytes(qa))
    offset = 0.0
    with qa.stream(frames, max_fps=1.0, name="growth") as stream:
        for source in sources:
            for frame in source.sample(max_fps=1.0, max_frames=10**6):
                stream.push(frame.image, offset + frame.timestamp)
                growth.tokens.append(stream.tokens)
                growth.carried.append(stream.stats.carried_tokens)
                growth.frame_ms.append(1e3 * stream.stats.frame_seconds[-1])
            offset += source.duration
    return growth


def _token_bytes(qa: Any) -> int:
    """Bytes of one token's keys and values over every layer of the model's language model."""
    config = qa.adapter.model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(qa.adapter.model.parameters()).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * element


def plot(growths: list[Growth], scored: list[Scored], families: list[str], path: Path) -> Path:
    """Three panels: accuracy per family and method; the carried state against the tokens seen; the wall time
    per frame along the stream."""
    from statekv.plotting import pyplot, save_figure

    plt = pyplot()
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.8 / len(scored)
    for index, run in enumerate(scored):
        shares = [100 * run.family(name)[0] / max(1, run.family(name)[1]) for name in families]
        left.bar([x + index * width for x in range(len(families))], shares, width, label=run.label)
    left.set_xticks([x + width * (len(scored) - 1) / 2 for x in range(len(families))], families, rotation=30)
    left.set_ylabel("accuracy (%)")
    left.set_ylim(0, 105)
    left.axhline(25, color="grey", linewidth=0.8, linestyle=":")
    left.set_title("held-out questions per family")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=len(scored), frameon=False)
    for growth, style in zip(growths, ("-", "--", "-.", ":"), strict=False):
        middle.plot(growth.tokens, growth.carried, style, label=growth.label)
        right.plot(range(1, len(growth.frame_ms) + 1), _rolling_median(growth.frame_ms, SMOOTHING), style,
                   label=growth.label)
    token_kib = growths[0].token_bytes / 1024 if growths else 1.0
    middle.secondary_yaxis("right", functions=(lambda t: t * token_kib, lambda k: k / token_kib)).set_ylabel(
        "KiB (keys and values, all layers)")
    middle.set_xlabel("tokens seen")
    middle.set_ylabel("carried state (tokens)")
    middle.set_title("what a new frame attends to")
    middle.legend(fontsize=7)
    right.set_xlabel("frame")
    right.set_ylabel(f"ms per frame (median of {SMOOTHING})")
    right.set_ylim(bottom=0)
    right.set_title("wall time per frame")
    right.legend(fontsize=7)
    figure.tight_layout()
    save_figure(figure, path, dpi=110)
    plt.close(figure)
    return path


def _rolling_median(values: list[float], span: int) -> list[float]:
    return [statistics.median(values[max(0, i - span + 1):i + 1]) for i in range(len(values))]
