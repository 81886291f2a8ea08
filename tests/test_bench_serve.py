"""`statekv bench serve`: the load it sends (cameras at their rate, questions as a Poisson process, open loop), what
it makes of a run (lag, TTFT, goodput), the search for the most cameras held, and the command against a real
server of the built-in model."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")

from starlette.requests import Request as Incoming  # noqa: E402

from statekv.bench.command import Probe  # noqa: E402
from statekv.bench.load import LoadSettings, Request, Run, run_load, schedule  # noqa: E402
from statekv.bench.summary import Targets, held_all, summarize, table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("streams", "fps", "frames_per_s", "lag_p95_s", "ttft_p50_s", "ttft_p95_s", "goodput_streams", "failures",
          "mean_batch")


def test_cameras_capture_at_their_rate_and_questions_arrive_as_a_poisson_process():
    settings = LoadSettings(fps=2.0, duration=10.0, question_rate=0.5, seed=3)
    requests = schedule(4, settings, start=100.0)
    assert [r.due for r in requests] == sorted(r.due for r in requests)
    for stream in range(4):
        frames = [r.due for r in requests if r.stream == stream and r.kind == "frame"]
        assert len(frames) == 20 and 100.0 <= frames[0] < 100.5  # a phase inside one frame period
        assert np.allclose(np.diff(frames), 0.5)
    gaps = {}
    for burstiness in (0.25, 1.0, 4.0):  # gamma gaps: mean 1 / rate; squared variation 1 / burstiness
        many = schedule(400, LoadSettings(fps=1.0, duration=60.0, question_rate=0.5, burstiness=burstiness), 0.0)
        gaps[burstiness] = np.concatenate([np.diff([0.0] + [r.due for r in many if r.stream == s and
                                                            r.kind == "question"]) for s in range(400)])
    assert abs(gaps[1.0].mean() - 2.0) < 0.15
    variation = {b: g.var() / g.mean() ** 2 for b, g in gaps.items()}
    assert variation[0.25] > 2.0 and 0.8 < variation[1.0] < 1.2 and variation[4.0] < 0.5
    assert not [r for r in schedule(2, LoadSettings(question_rate=0.0), 0.0) if r.kind == "question"]


def _run(*streams: list[Request]) -> Run:
    return Run(len(streams), 0.0, [request for stream in streams for request in stream])


def _frames(stream: int, lag: float, count: int = 20) -> list[Request]:
    return [Request("frame", stream, due=k, sent=k, done=k + lag) for k in range(count)]


def _question(stream: int, ttft: float) -> Request:
    return Request("question", stream, due=5.0, sent=5.0, first_token=5.0 + ttft, done=5.0 + ttft + 0.1)


def test_a_camera_counts_in_goodput_when_held_at_real_time_with_its_ttft_under_the_target():
    targets = Targets(ttft_target=0.5, lag_target=1.0)
    run = _run(_frames(0, 0.1) + [_question(0, 0.2)],  # held, fast answers
               _frames(1, 0.1) + [_question(1, 0.9)],  # held, too slow to answer
               _frames(2, 2.0) + [_question(2, 0.2)],  # behind real time
               _frames(3, 0.1)[:-1] + [Request("frame", 3, due=19, sent=19, done=19.1, error="HTTP 409: no")])
    row = summarize(run, fps=1.0, duration=20.0, targets=targets, mean_batch=2.5, mean_question_batch=1.5)
    assert row["held_streams"] == 2 and row["goodput_streams"] == 1 and row["failures"] == 1
    assert row["frames_done"] == 79 and row["questions"] == 3 and row["mean_batch"] == 2.5
    never = [Request("frame", 0, due=3 + k, error="no stream") for k in range(2)]  # their camera could not be made
    unsent = summarize(_run(_frames(0, 0.1)[:3] + never), 1.0, 5.0, targets, None)
    assert (unsent["frames_scheduled"], unsent["frames_sent"], unsent["frames_done"]) == (5, 3, 3)
    assert row["mean_question_batch"] == 1.5
    assert row["ttft_p50_s"] == pytest.approx(0.2) and row["lag_p50_s"] == pytest.approx(0.1)
    spread = summarize(_run([Request("frame", 0, due=k, sent=k, done=k + (k + 1) / 100) for k in range(100)]),
                       1.0, 100.0, targets, None)  # lags 0.01 to 1.00 s
    assert [spread[f"lag_{name}_s"] for name in ("p50", "p95", "p99", "max")] == pytest.approx(
        [0.505, 0.9505, 0.9901, 1.0])
    assert not held_all(row) and held_all(summarize(_run(_frames(0, 0.1)), 1.0, 20.0, targets, None))
    assert set(FIELDS) <= set(row) and "| 4 | 1 |" in table([row])


def test_frames_a_run_gave_up_on_count_in_its_lag_and_requests_never_sent_are_not_failures():
    """Before: a server that fell behind was reported behind by its finished frames' lag alone (the slowest,
    cut off at the drain's end, left out), and requests never sent counted as failed requests, a stream that could
    not be made once for itself and once for each of its requests."""
    cut = [Request("frame", 0, due=k, sent=k, done=k + 1.5 + k) for k in range(5)]  # 1.5 s a frame, served in turn
    cut += [Request("frame", 0, due=5, sent=12.0, error="not answered", given_up=14.0)]
    cut += [Request("frame", 0, due=k, error="not sent", given_up=14.0) for k in range(6, 12)]
    row = summarize(_run(cut), fps=1.0, duration=12.0, targets=Targets(), mean_batch=None)
    lags = [1.5 + k for k in range(5)] + [14.0 - k for k in range(5, 12)]
    assert row["lag_p50_s"] == pytest.approx(float(np.percentile(lags, 50)))  # 5.5, not the finished frames' 3.5
    assert row["lag_max_s"] == pytest.approx(9.0) and row["frames_given_up"] == 7 and row["frames_done"] == 5
    assert (row["failures"], row["unsent"]) == (1, 6) and not held_all(row)
    never = Run(2, 0.0, _frames(0, 0.1, count=4) + [Request("frame", 1, due=k, error="its stream could not be made")
                                                   for k in range(4)], setup_failures=["HTTP 429: too many"])
    row = summarize(never, fps=1.0, duration=4.0, targets=Targets(), mean_batch=None)
    assert (row["failures"], row["unsent"], row["held_streams"]) == (1, 4, 1) and not held_all(row)


def test_find_max_doubles_then_bisects_and_stops_at_its_time_limit():
    tried = []

    class Fake(Probe):
        def __call__(self, count):
            tried.append(count)
            self.rows[count] = {"streams": count, "goodput_streams": count if count <= 11 else 0, "failures": 0,
                               "unsent": 0}
            return self.rows[count]

    settings = LoadSettings(duration=0.0, drain=0.0)
    rows, (most, complete) = Fake("url", "key", settings, Targets(), None).find_max(256)
    assert (most, complete) == (11, True) and tried == [1, 2, 4, 8, 16, 12, 10, 11]
    assert [row["streams"] for row in rows] == sorted(tried)
    tried.clear()
    _, (most, complete) = Fake("url", "key", settings, Targets(), None).find_max(256, start=32)
    assert (most, complete) == (11, True) and tried == [32, 16, 8, 12, 10, 11]  # a start not held: below it
    slow = LoadSettings(duration=5.0, drain=5.0)
    tried.clear()
    _, (most, complete) = Fake("url", "key", slow, Targets(), None).find_max(256, deadline=time.monotonic() + 1)
    assert (most, complete) == (1, False) and tried == [1]  # the first run runs whatever the time limit


def test_a_server_that_answers_its_model_list_with_an_error_is_named_before_any_camera(monkeypatch):
    import httpx

    from statekv.bench.server import ServerError

    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: httpx.Response(503, text="replicas restarting\nretry"))
    probe = Probe("http://127.0.0.1:9", "k", LoadSettings(), Targets(), None)
    with pytest.raises(ServerError, match=r"^http://127.0.0.1:9/v1/models answered 503: replicas restarting$"):
        probe.reach()
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: httpx.Response(401, text="no"))
    with pytest.raises(ServerError, match="refused the API key"):
        probe.reach()
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: httpx.Response(404, text="<!DOCTYPE HTML>"))
    with pytest.raises(ServerError, match=r"^http://127.0.0.1:9 is not a statekv server: it has no /v1/models$"):
        probe.reach()
    vllm = {"object": "list", "data": [{"id": "Qwen/Qwen3-VL-8B", "object": "model", "owned_by": "vllm"}]}
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: httpx.Response(200, json=vllm))
    with pytest.raises(ServerError, match="is not a statekv server: its /v1/models lists no statekv model"):
        probe.reach()
    ours = {"object": "list", "data": [{"id": "builtin", "object": "model", "owned_by": "statekv"}]}
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: httpx.Response(200, json=ours))
    probe.reach()


def _probe_runs(monkeypatch, run) -> None:
    """The command's runs are ``run(probe, count)``, with no server to reach or warm up."""
    monkeypatch.setattr(Probe, "reach", lambda self, stopped=False: None)
    monkeypatch.setattr(Probe, "warm_up", lambda self: None)
    monkeypatch.setattr(Probe, "__call__", run)


def test_a_search_that_holds_every_count_up_to_its_cap_says_the_most_may_be_more(monkeypatch, tmp_path, capsys):
    from statekv.cli import main

    def held(self, count):  # every camera two tenths of a second behind, one question answered: held
        requests = [Request("frame", camera, due=k, sent=k, done=k + 0.2) for camera in range(count) for k in range(4)]
        requests.append(Request("question", 0, due=1.0, sent=1.0, first_token=1.1, done=1.2))
        self.rows[count] = summarize(Run(count, 0.0, requests), fps=1.0, duration=4.0, targets=Targets(),
                                     mean_batch=1.0)
        return self.rows[count]

    _probe_runs(monkeypatch, held)
    out = tmp_path / "search.json"
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--api-key", "k", "--find-max", "--max-streams", "4",
                 "--fps", "1", "--json", str(out)]) == 0
    assert "at least 4 streams (the search's cap, --max-streams 4)" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["max_streams_held"] == 4 and document["search_capped"] is True


def test_a_sweep_whose_every_request_failed_names_the_error_and_exits_1(monkeypatch, capsys):
    """Before: a server refusing every request (429: its stream limit) gave a table of zeros and exit 0; the
    cause was only in the JSON's ``errors``."""
    from statekv.cli import main

    def refused(self, count):
        requests = [Request("frame", camera, due=k, sent=k, done=k + 0.01, error="429: too many streams")
                    for camera in range(count) for k in range(4)]
        self.rows[count] = summarize(Run(count, 0.0, requests), fps=1.0, duration=4.0, targets=Targets(),
                                     mean_batch=None)
        return self.rows[count]

    def refused_past_one(self, count):
        return (held_one if count == 1 else refused)(self, count)

    def held_one(self, count):
        self.rows[count] = summarize(_run(_frames(0, 0.1, count=4)), fps=1.0, duration=4.0, targets=Targets(),
                                     mean_batch=1.0)
        return self.rows[count]

    argv = ["bench", "serve", "--url", "http://127.0.0.1:9", "--api-key", "k", "--streams", "1,2", "--fps", "1",
            "--duration", "4"]
    _probe_runs(monkeypatch, refused)
    assert main(argv) == 1
    printed = capsys.readouterr()
    assert "2 streams: 8 failed requests, e.g. 429: too many streams" in printed.out
    assert "1 stream: 4 failed requests, e.g. 429" in printed.out
    assert "every request failed" in printed.err and "Traceback" not in printed.err
    _probe_runs(monkeypatch, refused_past_one)  # one run measured something: its table stands, exit 0
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "2 streams: 8 failed requests" in printed.out and "1 stream:" not in printed.out and not printed.err


def test_a_sweep_stopped_part_way_reports_the_runs_it_finished(monkeypatch, tmp_path, capsys):
    """Before: Ctrl-C in the third run of --streams 1,4,16 lost the first two (no table, no JSON); in the first, it
    wrote no JSON, so an earlier sweep's file at ``--json`` read as this one's."""
    from statekv.cli import main

    def run_or_stop(self, count):
        assert self.url == "http://127.0.0.1:9"  # the server's root, from its OpenAI base URL
        if count > 1:
            raise KeyboardInterrupt
        self.rows[count] = summarize(_run(_frames(0, 0.1, count=4)), fps=1.0, duration=4.0, targets=Targets(),
                                     mean_batch=1.0)
        return self.rows[count]

    _probe_runs(monkeypatch, run_or_stop)
    (tmp_path / "my runs").mkdir()
    out = tmp_path / "my runs" / "sweep.json"
    argv = ["bench", "serve", "--url", "http://127.0.0.1:9/v1/", "--api-key", "secret-key", "--streams", "1,4,16",
            "--fps", "1", "--duration", "4", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", ["statekv", *argv])  # the command line the JSON records
    assert main(argv) == 130
    printed = capsys.readouterr().out
    assert "| 1 | 1 | 1.0 |" in printed and "interrupted: the runs above finished before the stop" in printed
    document = json.loads(out.read_text())
    assert document["interrupted"] is True and [row["streams"] for row in document["results"]] == [1]
    assert "--api-key KEY --streams" in document["command"] and "secret-key" not in out.read_text()  # shared
    assert shlex.split(document["command"])[-1] == str(out)  # pasted into a shell, a path with a space is one

    out.write_text('{"results": "an earlier sweep"}')  # stopped in its first run: said, and the file is this run's

    def stop_at_once(self, count):
        raise KeyboardInterrupt

    _probe_runs(monkeypatch, stop_at_once)
    assert main(argv) == 130
    assert "stopped before a run finished: nothing was measured" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["interrupted"] is True and document["results"] == []


def test_a_server_that_dies_during_the_runs_ends_them_in_one_line_after_reporting_those_finished(
        monkeypatch, tmp_path, capsys):
    """Before: bench serve went on against its dead server, tabled a run of nothing but failures, and exited 0
    (with --find-max: 0 streams held, the search complete). The runs are the command's own (`Probe.__call__`),
    their load and the server's metrics stood in for."""
    import statekv.bench.load as load_module
    import statekv.bench.server as server_module
    from statekv.bench.server import ServerError
    from statekv.cli import main

    class Dying:  # the server bench serve starts: it dies during its second run
        url, key, runs = "http://127.0.0.1:9", "k", 0

        def __init__(self, options, threads=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def check_running(self):
            if Dying.runs >= 2:
                raise ServerError("the server statekv bench serve started exited (status -9) during the runs: gone")

    async def load(url, key, count, settings, frames, show=None, ready=None):
        Dying.runs += 1
        return _run(*[_frames(camera, 0.1, count=4) for camera in range(count)])

    monkeypatch.setattr(server_module, "LocalServer", Dying)
    monkeypatch.setattr(server_module, "histogram_totals", lambda url, metric=None: None)
    monkeypatch.setattr(load_module, "run_load", load)
    monkeypatch.setattr(Probe, "reach", lambda self: None)
    monkeypatch.setattr(Probe, "warm_up", lambda self: None)
    out = tmp_path / "runs.json"
    assert main(["bench", "serve", "--streams", "1,2,4", "--fps", "1", "--duration", "4", "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert "| 1 | 1 | 1.0 |" in captured.out and captured.err.strip().endswith("during the runs: gone")
    assert [row["streams"] for row in json.loads(out.read_text())["results"]] == [1]  # not the dead server's run
    assert Dying.runs == 2  # no run started against it once it was found dead


class _SlowServer:
    """The stream routes of a server that takes ``push_seconds`` per frame, one frame at a time per stream, and
    answers every question with one token after ``ttft_seconds``, on a loopback port in a thread."""

    def __init__(self, push_seconds: float, ttft_seconds: float, streams: int | None = None,
                 hang_deletes: bool = False):
        """streams: how many streams it makes before it refuses the key (401); hang_deletes: it answers a deletion
        only after six seconds."""
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse

        app, locks = FastAPI(), {}
        self.arrivals: list[tuple[str, float]] = []
        self.deleted: list[str] = []

        @app.post("/v1/streams", status_code=201)
        async def create():
            if streams is not None and len(locks) >= streams:
                return JSONResponse({"error": {"message": "unknown API key"}}, status_code=401)
            locks[f"st_{len(locks)}"] = asyncio.Lock()
            return {"id": f"st_{len(locks) - 1}"}

        @app.post("/v1/streams/{stream_id}/frames")
        async def frame(stream_id: str, request: Incoming):
            await request.body()
            self.arrivals.append(("frame", time.perf_counter()))
            async with locks[stream_id]:
                await asyncio.sleep(push_seconds)
            return {"kept": True}

        @app.post("/v1/streams/{stream_id}/ask")
        async def ask(stream_id: str):
            self.arrivals.append(("question", time.perf_counter()))

            async def events():
                await asyncio.sleep(ttft_seconds)
                yield 'data: {"token": "B"}\n\n'
                yield 'event: answer\ndata: {"answer": "B"}\n\n'

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.delete("/v1/streams/{stream_id}")
        async def delete(stream_id: str):
            self.deleted.append(stream_id)
            if hang_deletes:  # longer than the test's bound on deletions; not for good, so the server can stop
                await asyncio.sleep(6)
            return {"deleted": True}

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextlib.contextmanager
def _no_collection_pauses():
    """The test process's garbage collector held off: late in a full run a collection over its heap stops every
    thread of the process, the load generator's and the test server's alike, which would read as lateness."""
    enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.unfreeze()


def test_a_slow_server_leaves_cameras_behind_while_questions_go_out_on_time():
    """Open loop: a server that takes 0.3 s a frame cannot keep a 5-fps camera at real time, and its lag grows
    frame after frame; the camera's frames go in order, one at a time; questions are sent at their times whatever
    is under way, and their TTFT is the first token's."""
    settings = LoadSettings(fps=5.0, duration=3.0, question_rate=2.0, drain=10.0, warm_frames=1, seed=1)
    with _SlowServer(push_seconds=0.3, ttft_seconds=0.1) as url, _no_collection_pauses():
        run = asyncio.run(run_load(url, "key", 2, settings, lambda camera: [b"jpeg"]))
    frames = sorted((r for r in run.requests if r.kind == "frame" and r.stream == 0), key=lambda r: r.due)
    lags = [r.done - r.due for r in frames]
    assert all(r.ok for r in run.requests) and len(frames) == 15
    # 0.1 s further a frame (a loaded machine's scheduling may delay one frame's answer by a few hundredths)
    assert lags[-1] > lags[0] + 1.0 and all(b > a - 0.05 for a, b in zip(lags[3:], lags[4:]))
    assert all(b.sent >= a.done for a, b in zip(frames, frames[1:]))  # in order, one at a time
    questions = [r for r in run.requests if r.kind == "question"]
    assert len(questions) >= 4 and all(r.sent - r.due < 0.2 for r in questions)  # never held back by a frame's 0.3 s
    assert all(0.09 < r.first_token - r.sent < 0.3 for r in questions)
    row = summarize(run, 5.0, 3.0, Targets(), None)
    assert row["held_streams"] == 0 and row["frames_per_s"] < 2 * 5.0 * 0.75


def test_a_drain_of_zero_waits_for_the_runs_end_not_its_last_frames_due_time():
    """Before: ``--drain 0`` cancelled the last frame while the server was still taking it (30 ms), so a server that
    kept up lost a frame and a camera from its goodput."""
    settings = LoadSettings(fps=2.0, duration=2.0, question_rate=0.0, drain=0.0, warm_frames=1, seed=3)
    with _SlowServer(push_seconds=0.03, ttft_seconds=0.01) as url, _no_collection_pauses():
        run = asyncio.run(run_load(url, "key", 2, settings, lambda camera: [b"jpeg"]))
    frames = [r for r in run.requests if r.kind == "frame"]
    assert len(frames) == 8 and all(r.ok for r in frames), [r.error for r in frames]


def _bench(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "statekv.cli", "bench", "serve", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--streams", "0,2"], "--streams: expected stream counts like 1,4,16, got '0,2'"),
    (["--fps", "-1"], "--fps: expected a positive number"),
    (["--route", "grpc"], "--route: invalid choice"),
    (["--url", "http://127.0.0.1:9", "--budget", "8"], "--budget is for the server bench serve starts"),
    (["--url", "http://127.0.0.1:9"], "--url needs --api-key"),
    (["--json", "/"], "--json / names a folder"),
    (["--video", "missing.mp4"], "missing.mp4"),
    (["--fps", "0.1", "--duration", "5"], "schedules no frame to measure; run at least 10 s"),
    (["--question", " "], "--question must be a question, not empty"),
    (["--fps", "1e200", "--duration", "1e200"], "schedules more frames a camera than a run can send"),  # a traceback
    (["--streams", "1,300"], "--streams 300: the server bench serve starts holds at most 256 cameras"),  # a hang:
    (["--url", "http://127.0.0.1:9", "--api-key", "x", "--streams", "99999999"],  # a client made per camera first
     "--streams 99999999: against --url a run drives at most 1024 cameras"),
    (["--url", "http://127.0.0.1:9", "--api-key", "x", "--streams", "1", "--duration", "1"],
     "cannot reach http://127.0.0.1:9: "),  # a server that is not there is no table of failed requests
    (["--url", "http://[::1", "--api-key", "x", "--streams", "1", "--duration", "1"],  # tracebacks, both
     "--url 'http://[::1' is not a URL"),
    (["--url", "http://127.0.0.1:abc", "--api-key", "x", "--streams", "1", "--duration", "1"],
     "cannot reach http://127.0.0.1:abc: "),
])
def test_bad_flags_are_one_line_and_start_nothing(args, message, capsys):
    from statekv.cli import main

    try:
        code = main(["bench", "serve", *args])
    except SystemExit as stop:  # argparse's own refusals
        code = stop.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_the_command_refuses_a_bad_flag_as_a_process_too():
    result = _bench("--streams", "0,2", timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert "--streams: expected stream counts like 1,4,16, got '0,2'" in result.stderr, result.stderr


def test_the_built_in_model_under_bench_serve(tmp_path):
    """The command as the issue names it (shorter): a server of the built-in model started for the run, one and two
    cameras, every field of the JSON, the table, the plot; the server's batches read from its /metrics."""
    out, plot = tmp_path / "out.json", tmp_path / "serve.png"
    result = _bench("--model", "builtin", "--streams", "1,2", "--fps", "2", "--duration", "4", "--warm-frames", "4",
                    "--question-rate", "0.75", "--json", str(out), "--plot", str(plot))
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(out.read_text())
    rows = document["results"]
    assert [row["streams"] for row in rows] == [1, 2] and all(set(FIELDS) <= set(row) for row in rows)
    assert document["server"]["model"] == "builtin" and document["settings"]["fps"] == 2.0
    for row in rows:
        assert row["frames_done"] == row["frames_sent"] == 8 * row["streams"] and row["failures"] == 0
        assert row["lag_p95_s"] is not None and row["mean_batch"] >= 1.0
        # questions answered: the server's questions per answering batch, from its statekv_question_batch_size
        assert row["answers"] == 0 and row["mean_question_batch"] is None or row["mean_question_batch"] >= 1.0
        # and its own time to a first token (statekv_time_to_first_token_seconds): before each answer ended
        assert row["answers"] > 0 and 0 < row["server_ttft_mean_s"] <= row["latency_p99_s"]
    assert "| streams | fps | frames/s |" in result.stdout and plot.stat().st_size > 10_000
    progress = [line for line in result.stderr.splitlines() if line.startswith("statekv bench serve: ")]
    for streams in ("1 stream", "2 streams"):  # each run's last progress line counts all it did
        last = [line for line in progress if line.startswith(f"statekv bench serve: {streams}, ")][-1]
        assert f"4/4 s: {8 * int(streams[0])}/{8 * int(streams[0])} frames streamed" in last, last  # 2 fps


def test_the_chat_route_under_bench_serve_is_answered(tmp_path):
    """Its questions named a model ("statekv") the server does not serve, which the chat route refuses."""
    out = tmp_path / "out.json"
    result = _bench("--model", "builtin", "--streams", "1", "--fps", "2", "--duration", "3", "--warm-frames", "2",
                    "--question-rate", "1", "--route", "chat", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(out.read_text())["results"][0]
    assert row["failures"] == 0 and row["answers"] > 0, row


def test_a_stop_while_the_local_server_starts_leaves_no_server_and_no_folder(monkeypatch):
    from types import SimpleNamespace

    from statekv.bench import server as bench_server

    def stopped(seconds):  # Ctrl-C, or statekv's SIGTERM handler, while it waits for the server to listen
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_server, "time", SimpleNamespace(monotonic=time.monotonic, sleep=stopped))
    server = bench_server.LocalServer(["--model", "builtin"])
    with pytest.raises(KeyboardInterrupt), server:
        pytest.fail("the server cannot have started")
    arguments = server.process.args
    assert server.process.poll() is not None  # stopped and waited for, not left running
    assert not Path(arguments[arguments.index("--state-dir") + 1]).parent.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent's death is signalled on Linux")
def test_a_bench_killed_outright_leaves_no_server_of_its_own_running(tmp_path):
    # SIGKILL (the OOM killer, `timeout -s KILL`) runs no handler of the bench: its server must not be left behind,
    # holding its model's memory and its port, for good. Its temporary folder goes under tmp_path (before: one more
    # statekv-bench-* folder in /tmp at every run)
    import os
    import signal

    def children(pid: int) -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
        return found

    def running(pid: int) -> bool:
        try:
            return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
        except OSError:
            return False

    bench = subprocess.Popen([sys.executable, "-c", "from statekv.bench.server import LocalServer\n"
                              "with LocalServer(['--model', 'builtin']):\n    pass"], cwd=ROOT,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 10
        while not (server := children(bench.pid)) and time.monotonic() < deadline and bench.poll() is None:
            time.sleep(0.02)
        assert server, "the bench started no server"
        bench.send_signal(signal.SIGKILL)
        bench.wait()
        deadline = time.monotonic() + 10
        while running(server[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = running(server[0])
        if left:
            os.kill(server[0], signal.SIGKILL)
        assert not left, "the bench's server outlived it"
        assert [path.name[:14] for path in tmp_path.iterdir()] == ["statekv-bench-"]  # its folder, not /tmp's
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def test_streams_made_and_deleted_leave_nothing_behind(tmp_path):
    """benchmarks/serve_churn.py, a few cycles: every stream made is deleted with its files, and the report says so
    (the full run's figures are in docs/serving.md)."""
    out = tmp_path / "churn.md"
    result = subprocess.run([sys.executable, "benchmarks/serve_churn.py", "--cycles", "6", "--every", "3", "--out",
                             str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    assert [row[0] for row in rows[1:]] == ["| 1", "| 3", "| 6"]
    assert all(row[1] == "0" and row[2] == "0" for row in rows[1:]), rows  # no stream held, no file left


def test_frames_per_second_is_counted_over_the_runs_schedule():
    """Before: frames done over the time to the last one done, which the cameras' phases make shorter than the run
    (1 camera at 1 fps over 1 s read 1.6-3.7 frames/s), and a run whose server stopped read as real time."""
    targets = Targets()
    start = 0.0
    held = summarize(_run([Request("frame", 0, due=start + 0.7 + k, sent=start + 0.7 + k, done=start + 0.71 + k)
                           for k in range(5)]), 1.0, 5.0, targets, None)
    assert held["frames_per_s"] == pytest.approx(1.0)
    stopped = _run([Request("frame", 0, due=k + 0.5, sent=k + 0.5, done=k + 0.51,
                            error=None if k < 2 else "ConnectError: refused") for k in range(5)])
    assert summarize(stopped, 1.0, 5.0, targets, None)["frames_per_s"] == pytest.approx(2 / 5)
    behind = summarize(_run([Request("frame", 0, due=k, sent=k, done=2.0 * k + 1) for k in range(5)]), 1.0, 5.0,
                       targets, None)
    assert behind["frames_per_s"] == pytest.approx(5 / 9)  # the last done 9 s after the start
    uneven = _run([Request("frame", 0, due=k + 0.3, sent=k + 0.3, done=k + 0.31) for k in range(2)])
    assert summarize(uneven, 1.0, 2.5, targets, None)["frames_per_s"] == pytest.approx(1.0)  # 2 frames due in 2.5 s


def test_server_metrics_that_are_not_prometheus_text_are_unknown(monkeypatch):
    """Before: a /metrics kept private behind a proxy (an HTML 404, or an HTML page) stopped the run with a
    traceback, leaving its streams on the server."""
    import httpx

    from statekv.bench.server import metric_totals

    page = "<html><body>not here</body></html>"
    for status in (404, 200):
        monkeypatch.setattr(httpx, "get", lambda *args, status=status, **kwargs: httpx.Response(status, text=page))
        assert metric_totals("http://server", "statekv_step_batch_size", ("statekv_step_batch_size_sum",)) is None


def test_streams_made_before_a_creation_fails_are_deleted():
    """Before: a refusal while the cameras' streams were being made left those already made on the server."""
    from statekv.bench.load import LoadError

    settings = LoadSettings(fps=5.0, duration=1.0, question_rate=0.0, drain=1.0, warm_frames=1)
    server = _SlowServer(push_seconds=0.0, ttft_seconds=0.0, streams=2)
    with server as url:
        with pytest.raises(LoadError, match="refused the API key"):
            asyncio.run(run_load(url, "key", 4, settings, lambda camera: [b"jpeg"]))
    assert sorted(server.deleted) == ["st_0", "st_1"]


def test_a_server_that_never_deletes_a_stream_is_given_up_on_and_named(monkeypatch):
    """Before: a run waited up to ten minutes on each deletion of a server that hung, whatever its drain."""
    import statekv.bench.load as load_module
    from statekv.bench.server import ServerError

    monkeypatch.setattr(load_module, "DELETE_SECONDS", 1.0)
    settings = LoadSettings(fps=5.0, duration=1.0, question_rate=0.0, drain=1.0, warm_frames=1)
    server = _SlowServer(push_seconds=0.0, ttft_seconds=0.0, hang_deletes=True)
    with server as url:
        started = time.monotonic()
        run = asyncio.run(run_load(url, "key", 2, settings, lambda camera: [b"jpeg"]))
        assert time.monotonic() - started < 5
    assert len(run.undeleted) == 2 and "Timeout" in run.undeleted[0]
    assert all(request.ok for request in run.requests)  # the run itself was measured
    with pytest.raises(ServerError, match="did not delete 2 of a run's streams .*share the server with them"):
        Probe(url, "key", settings, Targets(), None).check_deleted(run)


def test_a_slow_server_is_measured_not_stopped_at_the_warm_up_and_requests_under_way_are_not_failed(capsys):
    """Review: requests still under way when the warm-up's drain ended were taken for a server that answers none,
    ending the sweep; and the progress line counted every request under way as failed."""
    from statekv.bench.summary import default_progress, failed

    settings = LoadSettings(fps=1.0, duration=1.0, question_rate=0.0, drain=0.5, warm_frames=1)
    with _SlowServer(push_seconds=2.5, ttft_seconds=0.0) as url:
        Probe(url, "key", settings, Targets(), type("Cameras", (), {"frames": lambda self, camera: [b"jpeg"]})()
              ).warm_up()  # before: ServerError, "answered none of the warm-up's requests"
    under_way = Run(1, 0.0, [Request("frame", 0, due=0.0, sent=0.0, done=0.1), Request("frame", 0, due=1.0, sent=1.0)])
    assert failed(under_way) == 0
    default_progress("1 stream", settings)(under_way, 1.5, final=True)
    assert capsys.readouterr().err.strip().endswith("0 answers, 0 failed")


def test_a_running_server_that_stops_answering_ends_the_runs_in_one_line_keeping_those_finished(
        monkeypatch, tmp_path, capsys):
    """Before: against --url a server that died went unnoticed: the runs after went on as tables of failures and
    --find-max reported the most held so far as complete, exit 0. And a warm-up of nothing but failures went on."""
    import httpx

    import statekv.bench.load as load_module
    import statekv.bench.server as server_module
    from statekv.cli import main

    runs = []

    async def load(url, key, count, settings, frames, show=None, ready=None):
        runs.append(count)
        return _run(*[_frames(camera, 0.1, count=4) for camera in range(count)])

    def models(url, **kwargs):
        if len(runs) >= 3:  # gone after the warm-up and the first measured run
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json={"data": [{"id": "builtin", "owned_by": "statekv"}]})

    monkeypatch.setattr(load_module, "run_load", load)
    monkeypatch.setattr(server_module, "histogram_totals", lambda url, metric=None: None)
    monkeypatch.setattr(httpx, "get", models)
    out = tmp_path / "runs.json"
    argv = ["bench", "serve", "--url", "http://127.0.0.1:9", "--api-key", "k", "--fps", "1", "--duration", "4",
            "--json", str(out)]
    assert main([*argv, "--find-max", "--max-streams", "8"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == ("statekv bench: error: http://127.0.0.1:9 stopped answering during the "
                                    "runs: connection refused")
    document = json.loads(out.read_text())
    assert document["interrupted"] is True and "max_streams_held" not in document
    assert [row["streams"] for row in document["results"]] == [1] and runs == [1, 1, 2]

    async def refused(url, key, count, settings, frames, show=None, ready=None):
        failed = [Request("frame", 0, due=k, sent=k, done=k + 0.01, error="HTTP 503: not ready") for k in range(4)]
        return _run(failed)

    monkeypatch.setattr(load_module, "run_load", refused)
    runs.clear()
    assert main([*argv, "--streams", "1,2"]) == 2
    assert capsys.readouterr().err.strip() == ("statekv bench: error: http://127.0.0.1:9 answered none of the "
                                               "warm-up's requests, e.g. HTTP 503: not ready")


@pytest.mark.parametrize("value, threads", [("4,2", 4), ("abc", None), ("0", None), ("", None), ("3", 3)])
def test_omp_num_threads_is_read_as_openmp_reads_it(monkeypatch, value, threads):
    from statekv.console import omp_threads

    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert omp_threads() == threads


def test_the_json_written_over_an_earlier_one_is_whole_or_not_written(tmp_path):
    """Before: the results were written in place, so a write cut short (a full disk, a kill) left a truncated JSON
    where the earlier run's file had been."""
    path = tmp_path / "bench.json"
    path.write_text('{"earlier": true}\n')
    child = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from statekv.bench.summary import write_json\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # a write past it fails, as on a full disk\n"
        "try:\n"
        "    write_json(Path(sys.argv[1]), {'results': ['x' * 100] * 200})\n"
        "except OSError:\n"
        "    sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert json.loads(path.read_text()) == {"earlier": True}
    assert sorted(item.name for item in tmp_path.iterdir()) == ["bench.json"]
