"""`statekv bench serve --find-max`'s bounds: a server's own limit of streams is not the cameras it holds."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from statekv.bench.command import Probe  # noqa: E402
from statekv.bench.load import LoadSettings, Request, Run  # noqa: E402
from statekv.bench.summary import Targets, summarize  # noqa: E402

LIMIT = 64  # the streams the server makes (statekv serve's default --max-streams); it holds every one of them


def _run(self: Probe, count: int) -> dict:
    """A run of ``count`` cameras against a server that makes ``LIMIT`` streams, refusing the rest (429), and holds
    every camera it made at real time."""
    made = min(count, LIMIT)
    requests = [Request("frame", camera, due=k, sent=k, done=k + 0.1) for camera in range(made) for k in range(4)]
    requests += [Request("frame", camera, due=k, error="its stream could not be made or warmed up")
                 for camera in range(made, count) for k in range(4)]
    refused = ["HTTP 429: the server holds its limit of 64 streams"] * (count - made)
    run = Run(count, 0.0, requests, setup_failures=refused, refused=count - made)
    self.rows[count] = summarize(run, fps=1.0, duration=4.0, targets=Targets(), mean_batch=1.0)
    return self.rows[count]


def test_a_search_that_reaches_the_servers_stream_limit_stops_there_and_says_the_most_may_be_more():
    """Before: past the server's 64 streams each run failed its refused cameras, so the search bisected down to 64
    (128, 96, 80, 72, 68, 66, 65: seven runs of refusals) and reported 64 cameras as the most held, a complete
    search, though the server held every camera it made."""
    tried = []

    class Fake(Probe):
        def __call__(self, count):
            tried.append(count)
            return _run(self, count)

    probe = Fake("url", "key", LoadSettings(duration=4.0, drain=0.0), Targets(), None)
    rows, (most, complete) = probe.find_max(1024)
    assert (most, complete) == (LIMIT, True) and tried == [1, 2, 4, 8, 16, 32, 64, 128]
    assert probe.stream_limit == LIMIT and rows[-1]["streams_refused"] == 64
    tried.clear()
    probe = Fake("url", "key", LoadSettings(duration=4.0, drain=0.0), Targets(), None)
    _, (most, complete) = probe.find_max(1024, start=48)
    assert (most, complete) == (LIMIT, True) and tried == [48, 96, 64]  # the limit itself tried: held


def test_the_command_names_the_servers_stream_limit_as_the_searchs_bound(monkeypatch, tmp_path, capsys):
    from statekv.cli import main

    monkeypatch.setattr(Probe, "reach", lambda self, stopped=False: None)
    monkeypatch.setattr(Probe, "warm_up", lambda self: None)
    monkeypatch.setattr(Probe, "__call__", _run)
    out = tmp_path / "search.json"
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--api-key", "k", "--find-max", "--fps", "1",
                 "--duration", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "at least 64 streams (the server's limit of 64 streams: it refused more, 429)" in printed, printed
    document = json.loads(out.read_text())
    assert document["max_streams_held"] == 64 and document["search_capped"] is True
    assert document["server_stream_limit"] == 64


def test_a_run_counts_the_streams_the_server_refused_at_its_limit(monkeypatch):
    import asyncio

    import httpx

    from statekv.bench.load import run_load

    made = []

    def server(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/streams":
            if made:
                return httpx.Response(429, json={"error": {"message": "the server holds its limit of 1 streams"}})
            made.append("st_0")
            return httpx.Response(201, json={"id": "st_0"})
        return httpx.Response(200, json={"kept": True})

    client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kwargs: client(transport=httpx.MockTransport(server), **kwargs))
    settings = LoadSettings(fps=5.0, duration=0.2, question_rate=0.0, drain=0.0, warm_frames=1)
    run = asyncio.run(run_load("http://server", "key", 2, settings, lambda camera: [b"jpeg"]))
    assert run.refused == 1 and run.setup_failures == ["HTTP 429: the server holds its limit of 1 streams"]
    assert summarize(run, 5.0, 0.2, Targets(), None)["streams_refused"] == 1



def test_streams_whose_creation_failed_otherwise_are_not_counted_as_made(monkeypatch):
    """Before: the streams a run made were its cameras less those refused (429), so a camera whose creation failed
    otherwise (a 500) counted as made: of 3 cameras, one made, one failed, one refused, the server's limit read 2
    streams, and the search tried 2 where the server makes 1."""
    import asyncio

    import httpx

    from statekv.bench.load import run_load

    created = []

    def server(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/streams":
            created.append(None)
            if len(created) == 1:
                return httpx.Response(201, json={"id": "st_0"})
            if len(created) == 2:
                return httpx.Response(500, json={"error": {"message": "internal error"}})
            return httpx.Response(429, json={"error": {"message": "the server holds its limit of 1 streams"}})
        return httpx.Response(200, json={"kept": True})

    client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kwargs: client(transport=httpx.MockTransport(server), **kwargs))
    settings = LoadSettings(fps=5.0, duration=0.2, question_rate=0.0, drain=0.0, warm_frames=1)
    run = asyncio.run(run_load("http://server", "key", 3, settings, lambda camera: [b"jpeg"]))
    three = summarize(run, 5.0, 0.2, Targets(), None)
    tried = []

    class Fake(Probe):
        def __call__(self, count):
            tried.append(count)
            return three if count == 3 else _run(self, count)

    probe = Fake("url", "key", LoadSettings(duration=4.0, drain=0.0), Targets(), None)
    _, (most, complete) = probe.find_max(3, start=3)
    assert probe.stream_limit == 1 and tried == [3, 1] and (most, complete) == (1, True)


def test_a_server_that_refuses_every_stream_is_said_to_in_one_clear_line(monkeypatch, tmp_path, capsys):
    """Before: a search whose run the server refused every stream of (429: it held its limit, with others' streams)
    reported "at least 0 streams (the server's limit of 0 streams: it refused more, 429)". Now it says the server
    refused every stream."""
    from statekv.cli import main

    def refused(self: Probe, count: int) -> dict:
        requests = [Request("frame", camera, due=k, error="its stream could not be made or warmed up")
                    for camera in range(count) for k in range(4)]
        run = Run(count, 0.0, requests, setup_failures=["HTTP 429: the server holds its limit"] * count, refused=count)
        self.rows[count] = summarize(run, fps=1.0, duration=4.0, targets=Targets(), mean_batch=1.0)
        return self.rows[count]

    monkeypatch.setattr(Probe, "reach", lambda self, stopped=False: None)
    monkeypatch.setattr(Probe, "warm_up", lambda self: None)
    monkeypatch.setattr(Probe, "__call__", refused)
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--api-key", "k", "--find-max", "--fps", "1",
                 "--duration", "4"]) == 1  # nothing measured
    printed = capsys.readouterr().out
    assert "0 stream" not in printed and "the server refused every stream" in printed, printed
