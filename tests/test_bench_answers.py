"""`statekv bench serve`'s streamed answers: what it reads of each (its pieces of text as they came, the tokens the
server counted, an empty one), and the figures of their pace (ITL, TPOT) a run's row and table report, from
synthetic times, never a clock's."""

from __future__ import annotations

import asyncio
import itertools
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")

from statekv.bench.load import Request, Run, read_answer  # noqa: E402
from statekv.bench.summary import Targets, summarize, table  # noqa: E402


def _lines(*lines: str):
    async def given():
        for line in lines:
            yield line

    return given()


def _read(route: str, *lines: str, times=None) -> Request:
    """A question sent at 0, its answer's ``lines`` read with a clock that gives ``times`` in turn."""
    request = Request("question", 0, due=0.0, sent=0.0)
    clock = iter(times or itertools.count(1.0))
    asyncio.run(read_answer(request, _lines(*lines), route, clock=lambda: float(next(clock))))
    return request


def _ask_events(*pieces: str, tokens: int | None = None) -> list[str]:
    lines = []
    for piece in pieces:
        lines += [f"data: {json.dumps({'token': piece})}", ""]
    usage = {} if tokens is None else {"usage": {"completion_tokens": tokens}}
    return lines + ["event: answer", f"data: {json.dumps({'answer': ''.join(pieces), **usage})}", ""]


def _chat_events(*pieces: str, tokens: int | None = None) -> list[str]:
    def chunk(delta, **more):
        return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}], **more})}"

    lines = [chunk({"role": "assistant", "content": ""}), ""]  # the role first, no text: not a token
    lines += [line for piece in pieces for line in (chunk({"content": piece}), "")]
    lines += [chunk({}, finish_reason="stop"), ""]
    if tokens is not None:
        lines += [f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': tokens}})}", ""]
    return lines + ["data: [DONE]", ""]


@pytest.mark.parametrize("events, route", [(_ask_events, "ask"), (_chat_events, "chat")])
def test_each_piece_of_a_streamed_answer_is_timed_as_it_comes(events, route):
    """Before: only the first piece was timed, so the gaps between tokens (ITL, TPOT) were not measured."""
    request = _read(route, *events("The", " red", " circle", tokens=4), times=[0.2, 0.25, 0.4, 0.5])
    assert request.chunks == [0.2, 0.25, 0.4] and request.first_token == 0.2 and request.done == 0.5
    assert request.tokens == 4 and request.ok


def _answer(stream: int, sent: float, chunks: list[float], done: float, tokens: int | None) -> Request:
    return Request("question", stream, due=sent, sent=sent, first_token=chunks[0], done=done, chunks=chunks,
                   tokens=tokens)


def test_a_runs_row_reports_the_inter_token_latency_and_time_per_output_token_percentiles():
    """Before: a run's row and table reported TTFT and the answer's latency, but not the pace of its tokens."""
    frames = [Request("frame", 0, due=k, sent=k, done=k + 0.1) for k in range(10)]
    answers = [_answer(0, 1.0, [1.2, 1.3, 1.5], done=1.6, tokens=5),  # gaps 0.1, 0.2; TPOT 0.4 / 4
               _answer(0, 4.0, [4.1, 4.5], done=4.5, tokens=2),  # gap 0.4; TPOT 0.4 / 1
               _answer(0, 7.0, [7.3], done=7.3, tokens=1)]  # one token: no gap, no TPOT (as vLLM's)
    row = summarize(Run(1, 0.0, frames + answers), fps=1.0, duration=10.0, targets=Targets(), mean_batch=None)
    gaps, tpots = [0.1, 0.2, 0.4], [0.1, 0.4]
    for q in (50, 90, 95, 99):
        assert row[f"itl_p{q}_s"] == pytest.approx(float(np.percentile(gaps, q)))
        assert row[f"tpot_p{q}_s"] == pytest.approx(float(np.percentile(tpots, q)))
    assert row["itl_p50_s"] == pytest.approx(0.2) and row["tpot_p50_s"] == pytest.approx(0.25)
    header, _, cells = table([row]).splitlines()
    shown = dict(zip(header.strip("| ").split(" | "), cells.strip("| ").split(" | ")))
    assert shown["ITL p50 (s)"] == "0.200" and shown["TPOT p99 (s)"] == "0.397" and shown["TTFT p95 (s)"] == "0.290"
    quiet = summarize(Run(1, 0.0, frames), fps=1.0, duration=10.0, targets=Targets(), mean_batch=None)
    assert quiet["itl_p50_s"] is None and quiet["tpot_p99_s"] is None  # no answer: nothing to say
    unknown = [_answer(0, 1.0, [1.2, 1.3], done=1.4, tokens=None)]  # a server that does not count its tokens
    row = summarize(Run(1, 0.0, frames + unknown), fps=1.0, duration=10.0, targets=Targets(), mean_batch=None)
    assert row["itl_p50_s"] == pytest.approx(0.1) and row["tpot_p50_s"] is None



@pytest.mark.parametrize("events, route", [(_ask_events, "ask"), (_chat_events, "chat")])
def test_an_answer_streamed_without_text_is_a_failed_request_with_its_reason(events, route):
    """Before: a 200 whose stream carried no text counted as answered, its TTFT the stream's end, as though the
    server had answered; vLLM's bench fails a response without output."""
    empty = _read(route, *events(tokens=1), times=[0.3])
    assert not empty.ok and empty.error == "an empty answer: the server streamed no text"
    frames = [Request("frame", 0, due=k, sent=k, done=k + 0.1) for k in range(10)]
    row = summarize(Run(1, 0.0, frames + [empty]), fps=1.0, duration=10.0, targets=Targets(), mean_batch=None)
    assert (row["answers"], row["failures"], row["goodput_streams"]) == (0, 1, 0) and row["ttft_p50_s"] is None
    assert row["errors"] == ["an empty answer: the server streamed no text"]


@pytest.mark.parametrize("route, lines", [
    ("ask", ["event: error", 'data: {"error": "the model ran out of memory"}', ""]),
    ("chat", ['data: {"error": "the model ran out of memory"}', ""]),
])
def test_an_error_event_whose_error_is_a_string_fails_the_request_with_that_reason(route, lines):
    """Before: an error event whose ``error`` was a string, not an object, raised AttributeError, which the request
    did not catch, so it was misreported as not answered after the run. Now it fails with the string as its
    reason."""
    request = _read(route, *lines)
    assert request.error == "the model ran out of memory" and request.first_token is None
