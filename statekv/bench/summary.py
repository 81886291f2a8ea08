"""What a run of N cameras comes to: throughput, lag behind real time, time to first token, the answers' pace
(inter-token latency, time per output token), goodput; the progress line while it goes; the table, the JSON and the
plot of a sweep.

A camera is **held at real time** when every one of its requests succeeded, its frames were streamed within
``lag_target`` seconds of being due at p95, and it caught up in the run's last quarter (`caught_up`): a camera the
server cannot keep up with falls further behind with every frame, so its lag grows without bound, and one served a
little slower than real time stays under any lag target for a run short enough. **Goodput** counts the cameras
held at real time whose questions' p95 time to first token is at most ``ttft_target`` (vLLM's goodput: requests
meeting every latency target; here the unit a buyer counts is the camera). Percentiles interpolate linearly
(numpy's default, as vLLM reports them). As `vllm bench serve`'s, the **inter-token latency** (ITL) is every gap
between two pieces of text streamed in one answer, pooled over the answers (a piece may carry several tokens: it
waits for a whole character or word), and the **time per output token** (TPOT) one figure per answer of more than
one token: its seconds from first token to end over its tokens after the first (``usage.completion_tokens``). A
frame still out (or not yet sent) when the drain ends counts in the lag with the lag it had then, a lower bound:
those are a slow server's latest frames, and leaving them out would report it behind by less than it is.
**Failures** count the requests sent that failed (an answer streamed without text among them, as vLLM's) and the
streams that could not be made; requests never sent (their stream not made, or their camera still behind at the
drain's end) are ``unsent``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..flushing import write_whole
from .load import LoadSettings, Run


@dataclass(frozen=True)
class Targets:
    """``ttft_target``: seconds to the first answer token at p95; ``lag_target``: seconds behind real time at p95."""

    ttft_target: float = 0.5
    lag_target: float = 1.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, None when there are none."""
    return float(np.percentile(values, q)) if len(values) else None


def failed(run: Run) -> int:
    """The requests of ``run`` sent that failed (those still under way are not, until the drain gives them up), and
    its streams that could not be made."""
    return sum(r.sent is not None and r.error is not None for r in run.requests) + len(run.setup_failures)


def inter_token_latencies(answers: Sequence[Any]) -> list[float]:
    """The gaps between consecutive pieces of text streamed in each of ``answers``, pooled (seconds)."""
    return [later - earlier for r in answers for earlier, later in zip(r.chunks, r.chunks[1:])]


def times_per_output_token(answers: Sequence[Any]) -> list[float]:
    """Each answer's seconds from its first token to its end per token after the first, for those of more than one
    token the server counted."""
    return [(r.done - r.first_token) / (r.tokens - 1) for r in answers if r.tokens is not None and r.tokens > 1]


def frame_lags(frames: Sequence[Any]) -> list[float]:
    """Each frame's lag behind real time: streamed, or given up at the drain's end (a lower bound)."""
    return [r.done - r.due if r.ok else r.given_up - r.due for r in frames if r.ok or r.given_up is not None]


def caught_up(frames: Sequence[Any], since: float, fps: float) -> bool:
    """Whether a camera's backlog emptied after ``since`` (its last frame, if none is due by then): one of its frames
    due then was sent within half a period of being due, its predecessor streamed by then. A camera served slower
    than real time never catches up (each frame waits for the one before it), however little it is behind yet."""
    tail = [r for r in frames if r.due >= since] or list(frames[-1:])
    return any(r.sent is not None and r.sent - r.due <= 0.5 / fps for r in tail)


def default_progress(label: str, settings: LoadSettings) -> Callable[..., None]:
    """A progress line on stderr (``show(run, now, final=False)``): rewritten in place on a terminal, else one line
    every five seconds, and the run's last line (``final``) in either case."""
    terminal = sys.stderr.isatty()
    state = {"last": 0.0}

    def show(run: Run, now: float, final: bool = False) -> None:
        if not terminal and now - state["last"] < 5.0 and not final:
            return
        state["last"] = now
        frames = [r for r in run.requests if r.kind == "frame"]
        asks = [r for r in run.requests if r.kind == "question"]
        lags = [r.done - r.due for r in frames if r.ok]
        ttfts = [r.first_token - r.sent for r in asks if r.ok]
        failures = failed(run)
        lag, ttft = percentile(lags, 95), percentile(ttfts, 50)
        answers = sum(r.ok for r in asks)
        line = (f"statekv bench serve: {label}, {min(max(0.0, now - run.start), settings.duration):.0f}/"
                f"{settings.duration:g} s: {sum(r.ok for r in frames)}/{sum(r.due <= now for r in frames)} frames "
                f"streamed" + (f" (lag p95 {lag:.2f} s)" if lag is not None else "")
                + f", {answers} answer{'s' * (answers != 1)}"
                + (f" (TTFT p50 {ttft:.2f} s)" if ttft is not None else "")
                + f", {failures} failed")
        print(("\r" + line + "\033[K") if terminal else line, end="" if terminal else "\n", file=sys.stderr,
              flush=True)

    return show


def summarize(run: Run, fps: float, duration: float, targets: Targets, mean_batch: float | None, *,
              mean_question_batch: float | None = None, server_ttft_mean: float | None = None) -> dict[str, Any]:
    """One row of a sweep (times in seconds); ``mean_batch``: the server's stream steps per language-model forward
    over the run, ``mean_question_batch`` its questions per answering batch, ``server_ttft_mean`` its mean time
    from a streamed answer's start to its first generated token (each None when its /metrics do not say or it
    answered none)."""
    frames = [r for r in run.requests if r.kind == "frame"]
    asks = [r for r in run.requests if r.kind == "question"]
    done = [r for r in frames if r.ok]
    answered = [r for r in asks if r.ok]
    lags = frame_lags(frames)
    ttfts = [r.first_token - r.sent for r in answered]
    latencies = [r.done - r.sent for r in answered]
    late = [r.sent - r.due for r in asks if r.sent is not None]  # open loop: the load generator's own delay
    held = goodput = 0
    for stream in range(run.streams):
        own = [r for r in run.requests if r.stream == stream]
        own_frames = [r for r in own if r.kind == "frame"]
        lag = percentile(frame_lags(own_frames), 95)
        if any(not r.ok for r in own) or lag is None or lag > targets.lag_target or \
                not caught_up(own_frames, run.start + 0.75 * duration, fps):
            continue
        held += 1
        ttft = percentile([r.first_token - r.sent for r in own if r.kind == "question"], 95)
        goodput += ttft is None or ttft <= targets.ttft_target
    # over the run's whole schedule (each camera's frames are due one period apart across it), or longer when the
    # last is streamed late: a run whose server stopped or fell behind is not counted at its last success's pace
    scheduled = math.floor(duration * fps) / fps
    span = max(scheduled, max((r.done for r in done), default=run.start) - run.start)
    row = {"streams": run.streams, "fps": fps, "duration_s": duration, "frames_scheduled": len(frames),
           "frames_sent": sum(r.sent is not None for r in frames), "frames_done": len(done),
           "frames_per_s": len(done) / span if span > 0 else 0.0,
           "lag_p50_s": percentile(lags, 50), "lag_p95_s": percentile(lags, 95), "lag_p99_s": percentile(lags, 99),
           "lag_max_s": max(lags, default=None), "frames_given_up": sum(r.given_up is not None for r in frames),
           "questions": len(asks),
           "answers": len(answered)}
    timed = {"ttft": ttfts, "itl": inter_token_latencies(answered), "tpot": times_per_output_token(answered)}
    for name, values in timed.items():
        row.update({f"{name}_p{q}_s": percentile(values, q) for q in (50, 90, 95, 99)})
    for q in (50, 90, 99):
        row[f"latency_p{q}_s"] = percentile(latencies, q)
    errors = sorted({r.error for r in run.requests if r.error} | set(run.setup_failures))
    row.update(held_streams=held, goodput_streams=goodput, failures=failed(run), streams_refused=run.refused,
               streams_unmade=run.unmade,
               unsent=sum(r.sent is None for r in run.requests), mean_batch=mean_batch,
               mean_question_batch=mean_question_batch, server_ttft_mean_s=server_ttft_mean,
               question_send_late_p95_s=percentile(late, 95), errors=errors[:5])
    return row


def held_all(row: dict[str, Any]) -> bool:
    """Every camera of the run held at real time with its p95 time to first token under the target."""
    return row["goodput_streams"] == row["streams"] and row["failures"] == 0 and row["unsent"] == 0


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The sweep as a markdown table."""
    timed = [f"{name} p{q}" for name in ("TTFT", "ITL", "TPOT") for q in (50, 90, 95, 99)]
    lines = ["| streams | fps | frames/s | lag p50 (s) | lag p95 (s) | lag max (s) | "
             + " | ".join(f"{name} (s)" for name in timed) + " | answer p50 (s) | answer p90 (s) | answer p99 (s) | "
             "questions | goodput streams | failed | mean batch |",
             "|" + "---:|" * 25]
    for row in rows:
        cells = [str(row["streams"]), f"{row['fps']:g}", f"{row['frames_per_s']:.1f}"]
        names = ["lag_p50_s", "lag_p95_s", "lag_max_s"] + [f"{name.lower().replace(' ', '_')}_s" for name in timed]
        cells += [_seconds(row[name]) for name in names + ["latency_p50_s", "latency_p90_s", "latency_p99_s"]]
        cells += [str(row["questions"]), str(row["goodput_streams"]), str(row["failures"]),
                  "-" if row["mean_batch"] is None else f"{row['mean_batch']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def failure_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A line for each run with failed or unsent requests, naming the first of their errors (the JSON keeps up to
    five)."""
    return [f"{row['streams']} stream{'s' * (row['streams'] != 1)}: {row['failures']} failed request"
            f"{'s' * (row['failures'] != 1)}" + (f", {row['unsent']} not sent" if row["unsent"] else "")
            + (f", e.g. {row['errors'][0]}" if row["errors"] else "")
            for row in rows if row["failures"] or row["unsent"]]


def nothing_through(row: dict[str, Any]) -> bool:
    """Whether every request of a run failed: its zeros measure the errors, not the server."""
    return row["failures"] + row["unsent"] > 0 and row["frames_done"] == 0 and row["answers"] == 0


def machine() -> str:
    """The client's machine, as the reports name it, with its load average over the last minute (taken before a run:
    other work beside it slows a server on the same machine)."""
    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"{platform.machine()}, {os.cpu_count()} CPU cores{load}"


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, (json.dumps(document, indent=2) + "\n").encode())


def plot(rows: Sequence[dict[str, Any]], path: Path, targets: Targets, title: str) -> None:
    """Frames per second (against real time's N x fps) and time to first token (p50, p95, the target) against
    the cameras."""
    from ..plotting import pyplot, save_figure

    plt = pyplot()
    rows = sorted(rows, key=lambda row: row["streams"])
    streams = [row["streams"] for row in rows]
    figure, (rate, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    rate.plot(streams, [row["frames_per_s"] for row in rows], "o-", label="frames streamed per second")
    rate.plot(streams, [row["streams"] * row["fps"] for row in rows], "k--", label="real time (cameras x fps)")
    rate.set_xlabel("cameras")
    rate.set_ylabel("frames / s")
    rate.legend()
    for q, style in ((50, "o-"), (95, "s-")):
        points = [(row["streams"], row[f"ttft_p{q}_s"]) for row in rows if row[f"ttft_p{q}_s"] is not None]
        if points:
            ttft.plot(*zip(*points), style, label=f"TTFT p{q}")
    ttft.axhline(targets.ttft_target, color="k", linestyle="--", label=f"target {targets.ttft_target:g} s")
    ttft.set_xlabel("cameras")
    ttft.set_ylabel("seconds to the first answer token")
    ttft.set_yscale("log")
    ttft.legend()
    figure.suptitle(title)
    figure.tight_layout()
    save_figure(figure, path, dpi=110)
    plt.close(figure)
