"""The service under careless and hostile use (issue 39, the service's part): one damaged record quarantines its
stream alone, an unusable state folder is one line at start, limits hold under concurrency, a client that goes
away stops its generation, a push whose save fails changes nothing, and nothing of a deleted stream is left.

Each server runs in this process (uvicorn on a loopback port, the built-in model loaded once), so a test can make
a write fail where it must. Each case says what the service did before (on the main of issue 39's filing).
"""

from __future__ import annotations

import asyncio
import errno
import io
import json
import logging
import os
import shutil
import re
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")
import uvicorn  # noqa: E402
from PIL import Image  # noqa: E402

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.core.disk.files import hold  # noqa: E402
from statekv.serve import ServeConfig, create_app  # noqa: E402
from statekv.serve.sse import TokenStreamer  # noqa: E402
from statekv.synthetic.benchmark import make_benchmark  # noqa: E402

KEY, OTHER_KEY = "hostile-key-one", "hostile-key-two"
BUDGET = 64  # `statekv serve`'s default for the built-in model
QUESTION = "What colour was the triangle?"  # answered at length by the built-in model


@pytest.fixture(scope="module")
def options() -> ModelOptions:
    return ModelOptions(model="builtin", budget=BUDGET)


@pytest.fixture(scope="module")
def qa(options):
    return statekv.VideoQA.from_options(options)


class Running:
    """A server in this process, on a free loopback port."""

    def __init__(self, state: Path, qa, **settings):
        options = settings.pop("options", None) or ModelOptions(model="builtin", budget=BUDGET)
        if options.offload == "disk":
            qa = qa.with_options(offload="disk", offload_dir=options.offload_dir)
        self.config = ServeConfig(options=options, state_dir=state, api_keys=(KEY, OTHER_KEY), page=False,
                                  save_every_seconds=600, **settings)
        self.app = create_app(self.config, qa=qa)
        self.service = self.app.state.service
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def client(self, key: str = KEY) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()

    def __enter__(self) -> "Running":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _png(seed: int, size: tuple[int, int] = (48, 64)) -> bytes:
    image = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def _short_png(rows_held: int, rows_promised: int, width: int = 32) -> bytes:
    """A well-formed PNG whose header promises more rows than its image data holds."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((rows_held, width, 3), 200, dtype=np.uint8)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    struct.pack_into(">I", data, 20, rows_promised)  # IHDR's height
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))  # and its CRC
    return bytes(data)


def _push(client, stream_id: str, seed: int, t: float) -> httpx.Response:
    return client.post(f"/v1/streams/{stream_id}/frames?t={t}", content=_png(seed),
                       headers={"Content-Type": "image/png"})


def _stream(client, frames: int = 2, seed: int = 0, **settings) -> str:
    created = client.post("/v1/streams", json={"horizon_frames": 16, **settings})
    assert created.status_code == 201, created.text
    stream_id = created.json()["id"]
    for index in range(frames):
        _push(client, stream_id, seed + index, float(index)).raise_for_status()
    return stream_id


def _error(response, *statuses: int) -> str:
    """The one-line message of an error answer with one of ``statuses``."""
    assert response.status_code in statuses, (response.status_code, response.text[:300])
    message = response.json()["error"]["message"]
    assert "\n" not in message and "Traceback" not in message
    return message


# ---------------------------------------------------------------------------------------------------------------
# The service always starts
# ---------------------------------------------------------------------------------------------------------------
def test_one_damaged_record_quarantines_its_stream_alone_and_its_files_stay(qa, tmp_path):
    """Before: a keys.json with one bad entry kept the server from starting at all; an unreadable record was left
    out of every list (its stream silently gone); a save that could not be loaded was renamed aside and its stream
    started again empty; a save copied over another key's stream was served to that key."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client, server.client(OTHER_KEY) as other:
        ids = {name: _stream(client, seed=10 * i, name=name) for i, name in enumerate(["record", "save", "good"])}
        ids["theirs"] = _stream(other, seed=40, name="theirs")
        ids["mine"] = _stream(client, seed=50, name="mine")
    streams = state / "streams"
    (streams / f"{ids['record']}.json").write_text('{"id": "' + ids["record"] + '", "owner": ')  # cut short
    saved = streams / f"{ids['save']}.safetensors"
    saved.write_bytes(saved.read_bytes()[:-100])  # the disk lost its tail
    # another key's stream file moved under this key's stream (the record stays this key's)
    (streams / f"{ids['mine']}.safetensors").write_bytes((streams / f"{ids['theirs']}.safetensors").read_bytes())
    (state / "keys.json").write_text(json.dumps({"keys": [{"owner": 7}, "not an entry"]}))
    before = {path.name: path.read_bytes() for path in streams.iterdir()}

    with Running(state, qa) as server, server.client() as client, server.client(OTHER_KEY) as other:
        listed = {stream["id"]: stream for stream in client.get("/v1/streams").json()["data"]}
        assert listed[ids["good"]]["state"] == "ready" and listed[ids["good"]]["frames"] == 2
        answer = client.post(f"/v1/streams/{ids['good']}/ask", json={"question": QUESTION, "max_new_tokens": 4})
        assert answer.status_code == 200 and answer.json()["frames"] == 2
        for name, reason in (("record", "unreadable"), ("save", ""), ("mine", "")):
            stream = listed[ids[name]]
            assert stream["state"] == "damaged" and stream["damaged"] and "\n" not in stream["damaged"], stream
            assert reason in stream["damaged"]
            message = _error(_push(client, ids[name], 1, 9.0), 409)
            assert "damaged" in message and str(state) not in message
        assert "holds another stream" in listed[ids["mine"]]["damaged"]
        assert ids["theirs"] not in listed[ids["mine"]]["damaged"]  # never told another key's stream id
        exposed = client.get("/metrics").text  # before: nothing in /metrics said any stream was damaged
        assert "\nstatekv_streams_damaged 3.0\n" in exposed and "\nstatekv_queued 0.0\n" in exposed
        assert ids["theirs"] in {s["id"] for s in other.get("/v1/streams").json()["data"]}  # its owner's, served
        assert ids["mine"] not in {s["id"] for s in other.get("/v1/streams").json()["data"]}
        damaged = [ids[name] for name in ("record", "save", "mine")]
        assert {path.name: path.read_bytes() for path in streams.iterdir() if path.stem in damaged} == {
            name: data for name, data in before.items() if name.split(".")[0] in damaged}  # nothing moved or deleted
        assert client.delete(f"/v1/streams/{ids['save']}").status_code == 200  # its owner may delete it
        assert not list(streams.glob(f"{ids['save']}.*"))


def test_an_unusable_state_folder_is_one_line_at_start(tmp_path, capsys, monkeypatch):
    """Before: a state folder whose streams/ is a file, or a read-only one (nothing new can be made in it), stopped
    `statekv serve` with a traceback."""
    from statekv.cli import main

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "streams").write_text("not a folder")
    read_only = tmp_path / "read-only"
    read_only.mkdir()

    def refusing(real, writes):  # as a read-only filesystem: nothing new is made, nothing is written
        def call(path, *args, **kwargs):
            if str(path).startswith(str(read_only)) and writes(path, args, kwargs):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, *args, **kwargs)
        return call

    new = lambda path, args, kwargs: not os.path.exists(path)  # noqa: E731
    monkeypatch.setattr(os, "mkdir", refusing(os.mkdir, new))
    monkeypatch.setattr(os, "open", refusing(os.open, lambda path, args, kwargs: args[0] & (
        os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
    written = lambda path, args, kwargs: any(c in (args[0] if args else kwargs.get("mode", "r")) for c in "wxa+")  # noqa: E731
    monkeypatch.setattr(io, "open", refusing(io.open, written))
    for folder, reason in ((broken, "File exists|Not a directory"), (read_only, "Read-only file system")):
        status = main(["serve", "--state-dir", str(folder), "--port", "0", "--no-page"])
        printed = capsys.readouterr()
        lines = [line for line in printed.err.splitlines() if line.strip()]
        assert status == 2 and len(lines) == 1 and "Traceback" not in printed.err, printed.err
        assert re.search(reason, lines[0]) and "--state-dir" in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------------------------
# Limits hold under concurrency
# ---------------------------------------------------------------------------------------------------------------
def test_twelve_concurrent_creates_under_max_streams_3_make_exactly_3(qa, tmp_path):
    """Before: the limit was checked before the stream was made, on another thread, so 12 creates arriving
    together all passed it."""
    with Running(tmp_path / "state", qa, max_streams=3) as server:
        def create(_):
            with server.client() as client:
                return client.post("/v1/streams", json={"horizon_frames": 16})

        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(create, range(12)))
        statuses = sorted(reply.status_code for reply in replies)
        assert statuses == [201] * 3 + [429] * 9, statuses
        assert all("limit of 3 streams" in _error(reply, 429) for reply in replies if reply.status_code == 429)
        with server.client() as client:
            assert len(client.get("/v1/streams").json()["data"]) == 3
        assert len(list((tmp_path / "state" / "streams").glob("*.json"))) == 3


def test_max_asks_holds_for_streamed_answers_arriving_together(qa, tmp_path, monkeypatch):
    """Before: a streamed answer was checked against --max-asks when asked but took its slot only once its events
    began, so answers arriving together all passed the check."""
    slow_put, refused, lock, every_refusal = TokenStreamer.put, [], threading.Lock(), threading.Event()

    def put(self, value):  # no token before the asks beyond the slots are answered: the answers overlap
        every_refusal.wait(30)
        slow_put(self, value)

    monkeypatch.setattr(TokenStreamer, "put", put)
    with Running(tmp_path / "state", qa, max_asks=2) as server:
        with server.client() as client:
            stream_id = _stream(client)

        def ask(_):
            with server.client() as client:
                reply = client.post(f"/v1/streams/{stream_id}/ask",
                                    json={"question": QUESTION, "max_new_tokens": 8, "stream": True})
                with lock:
                    refused.append(reply.status_code == 429)
                    if sum(refused) == 6:
                        every_refusal.set()
                return reply.status_code, reply.text

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, range(8)))
        statuses = sorted(status for status, _ in replies)
        assert statuses == [200] * 2 + [429] * 6, statuses
        assert all("event: answer" in text for status, text in replies if status == 200)
        # a slot is given back once the server's side of the response ends, which can follow the client's last
        # byte by a moment: wait for it (a slot never given back fails)
        deadline = time.monotonic() + 5
        while server.service.ask_slots.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.service.ask_slots.held == 0


def test_max_tokens_zero_is_a_clear_400_on_both_routes(qa, tmp_path):
    """Before: the OpenAI route read max_tokens 0 as "not given" and answered 64 tokens."""
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = _stream(client)
        for field in ("max_tokens", "max_completion_tokens"):
            for value in (0, -1, 100_000, 1.5, True):
                reply = client.post("/v1/chat/completions", json={
                    "model": "builtin", field: value, "statekv": {"stream_id": stream_id},
                    "messages": [{"role": "user", "content": QUESTION}]})
                assert f"{field} must be an integer from 1 to 1024" in _error(reply, 400)
        for value in (0, -1, 100_000):
            reply = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": value})
            assert "max_new_tokens must be an integer from 1 to 1024" in _error(reply, 400)
        asked = {"model": "builtin", "statekv": {"stream_id": stream_id},
                 "messages": [{"role": "user", "content": QUESTION}]}
        both = client.post("/v1/chat/completions", json={**asked, "max_tokens": 1, "max_completion_tokens": 2})
        assert _error(both, 400) == ("max_tokens and max_completion_tokens differ; give one (max_tokens is its older "
                                     "name)")
        invalid = client.post("/v1/chat/completions", json={**asked, "max_tokens": 0, "max_completion_tokens": 2})
        assert "max_tokens must be an integer from 1 to 1024, got 0" in _error(invalid, 400)  # not "differ"
        one = client.post("/v1/chat/completions", json={**asked, "max_tokens": 1}).json()
        assert one["usage"]["completion_tokens"] == 1
        same = client.post("/v1/chat/completions", json={**asked, "max_tokens": 1, "max_completion_tokens": 1})
        assert same.json()["usage"]["completion_tokens"] == 1


def test_a_chat_over_a_stream_retrieves_as_ask_does_and_a_streams_setting_in_it_is_never_ignored(qa, tmp_path):
    """Before: a chat over a stream could not retrieve (\"unknown statekv field\"), and a stream's setting given at
    the request's top level (``retrieve``, ``budget``, ``method``) was answered 200 as if it had been applied."""
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = _stream(client, frames=6)
        for retrieve in (2, None):
            asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 8,
                                                                        "retrieve": retrieve}).json()
            chat = client.post("/v1/chat/completions", json={
                "model": "builtin", "max_tokens": 8, "statekv": {"stream_id": stream_id, "retrieve": retrieve},
                "messages": [{"role": "user", "content": QUESTION}]})
            assert chat.json()["choices"][0]["message"]["content"] == asked["answer"], chat.text
        told = server.service.registry.entries[stream_id].answers
        assert [answer.get("read_ranges") is None for answer in told[-4:]] == [False, False, True, True]
        base = {"model": "builtin", "messages": [{"role": "user", "content": QUESTION}]}
        for field, value, says in (("retrieve", 2, 'retrieve goes under "statekv"'),
                                   ("stream_id", stream_id, 'stream_id goes under "statekv"'),
                                   ("budget", 8, "budget is a stream's setting (POST /v1/streams)")):
            reply = client.post("/v1/chat/completions", json={**base, "statekv": {"stream_id": stream_id},
                                                              field: value})
            assert says in _error(reply, 400)
        bad = client.post("/v1/chat/completions", json={**base, "statekv": {"stream_id": stream_id, "retrieve": 0}})
        assert "statekv.retrieve must be a positive integer" in _error(bad, 400)


def test_an_unexpected_error_is_a_json_500_and_the_connection_serves_the_next_request(qa, tmp_path, monkeypatch):
    import statekv.serve.registry as registry

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = _stream(client)
        monkeypatch.setattr(registry, "prompt_tokens", broken)
        for _ in range(3):  # the same kept-alive connection each time
            asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION})
            assert asked.status_code == 500 and asked.json()["error"]["message"] == (
                "internal error (RuntimeError); the server log has the details")
            assert client.get(f"/v1/streams/{stream_id}").status_code == 200


def test_chat_says_it_reads_the_last_user_message_only(qa, tmp_path):
    """Before: a system message and earlier turns changed nothing (prompt_tokens the same) and nothing said so; the
    response says what it read and what it left out, the answer and its usage those of the last message alone."""
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = _stream(client)
        last = {"role": "user", "content": QUESTION}
        turns = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello?"},
                 {"role": "assistant", "content": "Hi."}, last]
        replies = []
        for messages in ([last], turns):
            reply = client.post("/v1/chat/completions", json={"model": "builtin", "max_tokens": 4, "messages": messages,
                                                              "statekv": {"stream_id": stream_id}})
            assert reply.status_code == 200, reply.text
            replies.append(reply.json())
        alone, with_turns = replies
        assert alone["statekv"]["read"] == with_turns["statekv"]["read"] == "the video and the last user message"
        assert "not_read" not in alone["statekv"]
        assert with_turns["statekv"]["not_read"] == {"system": 1, "earlier_turns": 2}
        assert alone["usage"] == with_turns["usage"]
        assert alone["choices"][0]["message"] == with_turns["choices"][0]["message"]
        streamed = client.post("/v1/chat/completions", json={"model": "builtin", "max_tokens": 4, "stream": True,
                                                             "messages": turns, "statekv": {"stream_id": stream_id}})
        finished = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
                    if line.startswith("data: {") and '"finish_reason": "' in line]
        assert finished[0]["statekv"]["not_read"] == {"system": 1, "earlier_turns": 2}
        assert "not_applied" not in finished[0]["statekv"] and "decoding" not in alone["statekv"]
        # before: sampling fields were dropped without a word; greedy values are what it does, others are named
        sampled = client.post("/v1/chat/completions", json={
            "model": "builtin", "max_tokens": 4, "messages": [last], "statekv": {"stream_id": stream_id},
            "temperature": 0.7, "top_p": 1, "seed": 3, "stop": ["."], "logprobs": False, "n": 1})
        assert sampled.status_code == 200, sampled.text
        assert sampled.json()["statekv"]["not_applied"] == ["temperature"]  # stop is applied
        assert sampled.json()["statekv"]["decoding"] == "greedy"
        assert sampled.json()["choices"] == alone["choices"]
        greedy = client.post("/v1/chat/completions", json={"model": "builtin", "max_tokens": 4, "messages": [last],
                                                           "statekv": {"stream_id": stream_id}, "temperature": 0})
        assert "not_applied" not in greedy.json()["statekv"]
        many = client.post("/v1/chat/completions", json={"model": "builtin", "messages": [last], "n": 3,
                                                         "statekv": {"stream_id": stream_id}})
        assert many.status_code == 400 and many.json()["error"]["message"] == (
            "n must be 1 (an answer is decoded once), got 3")
        for odd in ([stream_id], {"a": 1}, 7):
            refused = client.post("/v1/chat/completions", json={"model": "builtin", "messages": [last],
                                                                "statekv": {"stream_id": odd}})
            assert refused.status_code == 400 and refused.json()["error"]["message"] == (
                f"statekv.stream_id must be a stream's id (text), got {type(odd).__name__}")
        # a frame whose time would be past any number (a small max_fps, the last frame near the clock's end): one line,
        # not a 500 (normal doubles: a process that flushes subnormals to zero reads a max_fps of 1e-310 as 0)
        made = client.post("/v1/streams", json={"max_fps": 1e-307})
        assert made.status_code == 201, made.text
        tiny = made.json()["id"]
        pushed = [client.post(f"/v1/streams/{tiny}/frames{query}", content=_png(3),
                              headers={"Content-Type": "image/png"}) for query in ("?t=1.75e308", "?t=0", "")]
        assert [reply.status_code for reply in pushed] == [400, 200, 400]
        assert "past the latest time a stream takes" in pushed[0].json()["error"]["message"]
        assert "push it with its timestamp" in pushed[2].json()["error"]["message"]
        for query, message in (("?t=1&t=2", "t is given more than once; give an image's time once"),
                               ("?t=1&time=2", 'unknown query parameter "time"; an image takes t (seconds)')):
            reply = client.post(f"/v1/streams/{tiny}/frames{query}", content=_png(3),
                                headers={"Content-Type": "image/png"})
            assert _error(reply, 400) == message
        assert client.get(f"/v1/streams/{tiny}").json()["frames"] == 1


# ---------------------------------------------------------------------------------------------------------------
# A client that goes away stops its generation
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["ask", "chat", "ask whole", "chat whole"])
def test_a_client_that_disconnects_stops_its_generation_between_tokens(qa, tmp_path, monkeypatch, route):
    """Before: the generation of a streamed answer ran to its end after its client had gone, holding the model; an
    answer not streamed still did."""
    generated: list[int] = []
    real_put = TokenStreamer.put

    def put(self, value):
        generated.append(1)
        time.sleep(0.02)  # a slower model: the disconnection lands while tokens are still coming
        real_put(self, value)

    max_new = 200
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = _stream(client)
        whole = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": max_new})
        assert whole.json()["usage"]["completion_tokens"] == max_new  # left alone, it would generate them all
        monkeypatch.setattr(TokenStreamer, "put", put)
        if route.startswith("ask"):
            request = (f"/v1/streams/{stream_id}/ask", {"question": QUESTION, "max_new_tokens": max_new,
                                                        "stream": True})
        else:
            request = ("/v1/chat/completions", {"model": "builtin", "max_tokens": max_new, "stream": True,
                                                "statekv": {"stream_id": stream_id},
                                                "messages": [{"role": "user", "content": QUESTION}]})
        if route.endswith("whole"):
            with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=1.0,
                                                                headers={"Authorization": f"Bearer {KEY}"}) as leaving:
                leaving.post(request[0], json={**request[1], "stream": False})  # the client gives up waiting
        else:
            _leave_after_three_pieces(server, request)
        deadline = time.monotonic() + 20
        while server.service.worker.queued and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.service.worker.queued == 0  # the model is free
        assert 3 <= len(generated) < max_new // 2, len(generated)
        stopped = re.search(r"^statekv_answers_stopped_total (\S+)$", client.get("/metrics").text, re.M)
        assert stopped and float(stopped.group(1)) == 1.0
        answers = [a for a in client.get(f"/v1/streams/{stream_id}").json().get("answers", [])]
        assert len(answers) <= 1  # the stopped answer is not recorded as given
        again = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 4})
        assert again.status_code == 200


def _leave_after_three_pieces(server, request: tuple[str, dict]) -> None:
    with server.client() as leaving, leaving.stream("POST", request[0], json=request[1]) as reply:
        assert reply.status_code == 200
        pieces = 0
        for line in reply.iter_lines():
            pieces += line.startswith("data:") and ('"token"' in line or '"content"' in line)
            if pieces >= 3:
                break  # the client goes away


def test_a_client_gone_before_its_streamed_answer_began_stops_it_unanswered(qa, tmp_path, monkeypatch):
    """A streamed reply waits for its answer's generation to begin, so that a refusal keeps its own status; a client
    that leaves meanwhile (its question queued behind another answer) stops its question before it is answered."""
    real_put, held, puts = TokenStreamer.put, threading.Event(), []

    def put(self, value):
        puts.append(id(self))
        held.wait(30)  # the first answer holds the model until released
        real_put(self, value)

    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = _stream(client)
        monkeypatch.setattr(TokenStreamer, "put", put)
        ask, body = f"/v1/streams/{stream_id}/ask", {"question": QUESTION, "max_new_tokens": 2, "stream": True}
        first = threading.Thread(target=lambda: server.client().post(ask, json=body))
        first.start()
        deadline = time.monotonic() + 30
        while not puts and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=1.0,
                                                            headers={"Authorization": f"Bearer {KEY}"}) as leaving:
            leaving.post(ask, json=body)  # no reply while its question waits: the client leaves
        time.sleep(1.5)  # the route notices
        held.set()
        first.join(30)
        deadline = time.monotonic() + 30
        while server.service.worker.queued and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.service.worker.queued == 0 and len(set(puts)) == 1  # the second answer never began
        stopped = re.search(r"^statekv_answers_stopped_total (\S+)$", client.get("/metrics").text, re.M)
        assert stopped and float(stopped.group(1)) == 1.0


# ---------------------------------------------------------------------------------------------------------------
# A failed push changes nothing
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EROFS], ids=["disk full", "read-only"])
def test_a_push_whose_save_fails_is_refused_unstreamed_and_a_retry_streams_it_once(qa, tmp_path, monkeypatch,
                                                                                   number):
    """Before: the save due after a push failed after the frame was streamed: the push answered 400, and the
    client's retry streamed the frame a second time."""
    import statekv.api.stream_file as stream_file

    real = stream_file.save_file

    def failing(*args, **kwargs):
        raise OSError(number, os.strerror(number))

    with Running(tmp_path / "state", qa, save_every_frames=2) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
        monkeypatch.setattr(stream_file, "save_file", failing)
        for _ in range(2):  # the client retries: still refused, still unchanged
            message = _error(_push(client, stream_id, 2, 2.0), 503)
            assert os.strerror(number) in message and "not streamed" in message and "2 frames" in message
            assert str(tmp_path) not in message
            stats = client.get(f"/v1/streams/{stream_id}").json()
            assert (stats["frames"], stats["pushed"], stats["resume_from"]) == (2, 2, 2)
        monkeypatch.setattr(stream_file, "save_file", real)
        kept = _push(client, stream_id, 2, 2.0)
        assert kept.status_code == 200 and kept.json()["frames"] == 3 and kept.json()["saved"]["pushed"] == 2
        answer = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 6})
    alone = qa.stream(16, max_fps=1.0)
    for seed in range(3):
        alone.push(np.asarray(Image.open(io.BytesIO(_png(seed))).convert("RGB")), float(seed))
    assert answer.json()["answer"] == alone.ask(QUESTION, max_new_tokens=6)  # each frame streamed once


def test_answers_on_a_full_state_folder_log_its_record_failure_once_and_its_recovery(qa, tmp_path, monkeypatch,
                                                                                     caplog):
    """Before: each answer whose note could not be recorded (a full disk) logged the failure again, one line per
    answer; the same full disk read as a new reason each time (each write's partial file has a name of its own)."""
    import statekv.flushing as flushing
    import statekv.serve.entries as entries

    real = flushing.write_flushed

    def full(path, data):
        if str(path).endswith(".partial") and "streams" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data)

    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
        caplog.clear()
        monkeypatch.setattr(flushing, "write_flushed", full)
        with caplog.at_level(logging.WARNING, logger="statekv.serve"):
            for _ in range(4):
                asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 2})
                assert asked.status_code == 200, asked.text
            failures = [r.getMessage() for r in caplog.records if "cannot record" in r.getMessage()]
            assert len(failures) == 1, failures  # the first failure alone, saying what was not recorded
            assert "an answer" in failures[0] and stream_id in failures[0] and "No space left" in failures[0]
            monkeypatch.setattr(entries, "RECORD_FAILURE_LOG_SECONDS", 0.0)  # the period over: logged again, counted
            client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 2})
            failures = [r.getMessage() for r in caplog.records if "cannot record" in r.getMessage()]
            assert len(failures) == 2 and "3 more failed the same way" in failures[1], failures
            monkeypatch.setattr(flushing, "write_flushed", real)
            client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 2})
            again = [r.getMessage() for r in caplog.records if "written again" in r.getMessage()]
            assert len(again) == 1 and "5 writes had failed" in again[0], again


# ---------------------------------------------------------------------------------------------------------------
# No leftovers
# ---------------------------------------------------------------------------------------------------------------
def test_disk_tier_folders_are_reused_across_restarts_and_deleted_with_their_stream(qa, tmp_path, options):
    """Before: each restart loaded every stream into a new disk-tier folder (the old ones stayed), and DELETE left
    the stream's folder behind."""
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        ids = [_stream(client, frames=2, seed=seed) for seed in (0, 10)]
    folders = sorted(path.name for path in tier.iterdir())
    assert len(folders) == 2
    for restart in range(2):
        with Running(state, qa, options=disk) as server, server.client() as client:
            frames = [client.get(f"/v1/streams/{i}").json()["frames"] for i in ids]
            assert frames == [2, 2 + restart]  # every push kept, from the same file sets
            _push(client, ids[1], 99 + restart, 5.0 + restart).raise_for_status()
        assert sorted(path.name for path in tier.iterdir()) == folders  # the same folders, no new one
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert client.get(f"/v1/streams/{ids[1]}").json()["frames"] == 4
        assert client.delete(f"/v1/streams/{ids[0]}").status_code == 200
        assert len(list(tier.iterdir())) == 1 and not list((state / "streams").glob(f"{ids[0]}*"))


def test_a_whole_save_left_from_before_is_removed_once_the_disk_tier_saves_the_stream_even_across_a_kill(
        qa, tmp_path, options, monkeypatch):
    """Before: a stream saved whole (by a server without --offload disk) kept that save in the state folder after
    its disk-tier file set took over its saves (its record ``tier_saved``), never read, until it was deleted."""
    from statekv.serve.store import StreamFiles

    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
    whole = state / "streams" / f"{stream_id}.safetensors"
    assert whole.exists()
    real = StreamFiles.remove_state
    monkeypatch.setattr(StreamFiles, "remove_state", lambda self, stream_id: False)  # a kill right after the record
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 2
        _push(client, stream_id, 7, 5.0).raise_for_status()
    record = json.loads((state / "streams" / f"{stream_id}.json").read_text())
    assert record["tier_saved"] is True and whole.exists()  # its record first: the kill left both
    monkeypatch.setattr(StreamFiles, "remove_state", real)
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 3  # from its file set
        assert not whole.exists()  # removed at the start that found it
        _push(client, stream_id, 8, 6.0).raise_for_status()
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 4
    assert not list((state / "streams").glob(f"{stream_id}.safetensors*"))


def test_a_stream_saved_whole_then_in_its_disk_tier_keeps_no_whole_save(qa, tmp_path, options):
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
    assert (state / "streams" / f"{stream_id}.safetensors").exists()
    with Running(state, qa, options=disk) as server, server.client() as client:
        _push(client, stream_id, 7, 5.0).raise_for_status()
    assert json.loads((state / "streams" / f"{stream_id}.json").read_text())["tier_saved"] is True
    assert not (state / "streams" / f"{stream_id}.safetensors").exists()  # removed after its first save in the tier
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 3


def test_a_start_after_a_kill_says_what_each_stream_lost_in_its_log_and_its_info(qa, tmp_path, caplog):
    """Before: a server killed after frames were pushed and answered over, but before they were saved, came back
    without them and said nothing: neither its log nor the stream's info told the client to push them again."""
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        kept = _stream(client, frames=2)
        lost = _stream(client, frames=0, seed=20)
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        assert client.get(f"/v1/streams/{kept}").json()["lost"] is None  # stopped cleanly: saved at shutdown
        for index in range(3):
            _push(client, lost, 20 + index, float(index)).raise_for_status()
        asked = client.post(f"/v1/streams/{lost}/ask", json={"question": QUESTION, "max_new_tokens": 2})
        assert asked.status_code == 200 and asked.json()["frames"] == 3
        record, deadline = tmp_path / "state" / "streams" / f"{lost}.json", time.monotonic() + 30
        while not json.loads(record.read_text())["answers"]:  # its note is recorded after the answer is given
            assert time.monotonic() < deadline
            time.sleep(0.02)
        shutil.copytree(tmp_path / "state", tmp_path / "killed")  # killed here: its 3 frames were never saved
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="statekv.serve"):
        with Running(tmp_path / "killed", qa) as server, server.client() as client:
            info = client.get(f"/v1/streams/{lost}").json()
            assert info["frames"] == 0 and info["lost"] == {"pushed": 3, "frames": 3, "answers": 1}, info
            assert client.get(f"/v1/streams/{kept}").json()["lost"] is None
    said = [r.getMessage() for r in caplog.records if "came back without" in r.getMessage()]
    assert len(said) == 1 and lost in said[0] and "3 frames pushed" in said[0] and "1 answers" in said[0], said
    caplog.clear()  # said once: the starts after it, with nothing lost since, say nothing (the reviewer's finding)
    with caplog.at_level(logging.ERROR, logger="statekv.serve"):
        for _ in range(2):
            with Running(tmp_path / "killed", qa) as server, server.client() as client:
                assert client.get(f"/v1/streams/{lost}").json()["lost"] is None
    assert not [r.getMessage() for r in caplog.records if "came back without" in r.getMessage()]


def test_a_deletion_note_not_of_this_server_removes_nothing_at_the_next_start(qa, tmp_path, options, caplog):
    """Before: a start finishing deletions cut short removed whatever folder a note in streams/ named, and took a
    note's name as a pattern: a note named ``st_*.deleting`` removed every stream's record and save."""
    tier, state, victim = tmp_path / "tier", tmp_path / "state", tmp_path / "victim"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        ids = [_stream(client, frames=2, seed=seed) for seed in (0, 10)]
        cut_short = _stream(client, frames=1, seed=20)
    victim.mkdir()
    (victim / "kept").write_text("precious")
    streams = state / "streams"
    cut_short_tier = tier / json.loads((streams / f"{cut_short}.json").read_text())["tier"]
    assert cut_short_tier.is_dir()
    notes = {f"st_{'0' * 24}": victim, "st_evil": victim, "st_*": None, cut_short: cut_short_tier}
    for name, folder in notes.items():
        (streams / f"{name}.deleting").write_text(json.dumps({"id": name, "tier": folder and str(folder), "at": 1}))
    with caplog.at_level(logging.WARNING, logger="statekv.serve"), Running(state, qa, options=disk) as server, \
            server.client() as client:
        assert [client.get(f"/v1/streams/{i}").json()["frames"] for i in ids] == [2, 2]
        assert client.get(f"/v1/streams/{cut_short}").status_code == 404  # a real deletion cut short is finished
    assert (victim / "kept").read_text() == "precious" and not cut_short_tier.exists()
    assert "st_evil.deleting in the state folder names no stream; left as it is" in caplog.text
    assert f"names {victim}, not a disk-tier folder under this server's offload_dir; left as it is" in caplog.text


def test_a_disk_tier_stream_resumed_past_its_last_save_goes_on_from_its_own_time(qa, tmp_path, options, monkeypatch):
    """Before: a stream the disk tier brought back with more pushes than its record's last save (a kill between
    saves) had no time: a push without ``t`` was placed at 0 s and a file fed from its start was refused."""
    import statekv.core.disk.tier

    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 1)  # every step resumable
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk, save_every_frames=100) as server, server.client() as client:
        stream_id = _stream(client, frames=0, horizon_frames=None)
        for index in range(4):
            _push(client, stream_id, index, 2.0 * index).raise_for_status()
        assert client.get(f"/v1/streams/{stream_id}").json()["saved"]["pushed"] == 0
        shutil.copytree(state, tmp_path / "state-killed")  # what a kill leaves: the steps journaled, no save
        shutil.copytree(tier, tmp_path / "tier-killed")
    killed = options.with_changes(offload="disk", offload_dir=str(tmp_path / "tier-killed"))
    with Running(tmp_path / "state-killed", qa, options=killed) as server, server.client() as client:
        stats = client.get(f"/v1/streams/{stream_id}").json()
        assert (stats["frames"], stats["resume_from"], stats["resume_after_seconds"]) == (4, 4, 6.0)
        pushed = client.post(f"/v1/streams/{stream_id}/frames", content=_png(9), headers={"Content-Type": "image/png"})
        assert pushed.status_code == 200 and pushed.json()["frames"] == 5, pushed.text
        assert client.get(f"/v1/streams/{stream_id}").json()["resume_after_seconds"] > 6.0


def test_a_push_the_disk_tier_cannot_take_is_a_503_naming_no_server_path_and_the_next_one_goes_in(
        qa, tmp_path, options, monkeypatch):
    """Before: a push whose disk-tier step could not be written (a full disk) was a 400 "invalid request" naming
    the server's disk-tier folder."""
    from statekv.core.disk.tier import DiskTier
    from statekv.errors import OutputError

    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    commit = DiskTier.commit_step

    def full(self, *args, **kwargs):
        raise OutputError(f"cannot write the disk cache in {self.folder}: No space left on device")
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id = _stream(client, frames=2, horizon_frames=None)
        monkeypatch.setattr(DiskTier, "commit_step", full)
        refused = _push(client, stream_id, 5, 2.0)
        monkeypatch.setattr(DiskTier, "commit_step", commit)
        message = _error(refused, 503)
        assert refused.headers.get("Retry-After") and "No space left on device" in message
        assert str(tier) not in message and "the step was not taken" in message, message
        _push(client, stream_id, 5, 2.0).raise_for_status()
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 3


@pytest.fixture(scope="module")
def short_range(tmp_path_factory):
    """A tiny InternVL checkpoint of 512 positions (a stream hands over within 30 frames) and its VideoQA."""
    from statekv.testing import make_tiny_checkpoint

    short = {"max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    checkpoint = make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("short") / "ckpt", text_config=short,
                                      vision_config={"image_size": 112})
    return checkpoint, statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=24, reserve_tokens=24,
                                                       attention="eager")


def _moves_fail(monkeypatch) -> None:
    """A handover's moves of its successor's files into the stream's folder fail (a full disk); as in
    test_handover.py, ``os.replace`` itself is replaced, the other moves going through."""
    import statekv.core.disk.successor as successor_files

    replace = os.replace

    def full(source, target):
        if Path(source).parent.parent == Path(target).parent:  # a successor's file into its stream's folder
            raise OSError(errno.ENOSPC, "No space left on device")
        return replace(source, target)
    monkeypatch.setattr(successor_files.os, "replace", full)


@pytest.mark.parametrize("closed_by", ["push", "model thread"])
def test_a_stream_closed_by_a_handover_stopped_on_a_full_disk_is_brought_back_by_the_next_request(
        short_range, tmp_path, monkeypatch, closed_by):
    """The handover's move into the stream's folder fails once marked (the stream is closed): in a push (503, one
    line), or on the model's thread outside any request (as in a quiet moment's replay). While the disk is still
    full a request answers 503 naming the problem, and for its Retry-After every request answers so at once,
    without trying again; then the next push, or question, brings the stream back from its folder, handed over,
    every frame taken still there. Before: every later request failed ("this stream was closed") until the server
    restarted."""
    import statekv.serve.healing as healing_module
    from statekv.errors import HandoverError

    server, tier = _disk_tier_server(short_range, tmp_path)
    replace = os.replace
    with server, server.client() as client:
        stream_id = _stream(client, frames=0, horizon_frames=None, max_fps=None)
        entry = server.service.registry.entries[stream_id]
        _moves_fail(monkeypatch)
        for index in range(40):
            if closed_by == "push":
                pushed = _push(client, stream_id, index, float(index))
                if pushed.status_code != 200:
                    message = _error(pushed, 503)
                    assert pushed.headers.get("Retry-After") and "No space left on device" in message, message
                    assert str(tier) not in message and "brings it back" in message, message
                    assert "do not push this frame again" in message and "Stream.load" not in message, message
                    break
            else:
                try:
                    server.service.worker.run_blocking(entry.stream.push, _frame(index), float(index))
                except HandoverError:
                    break
        else:
            pytest.fail("the stream did not hand over")
        registry, tries = server.service.registry, []
        restore_one = registry.restore_one
        monkeypatch.setattr(registry, "restore_one", lambda *args: tries.append(args) or restore_one(*args))
        still = _error(client.get(f"/v1/streams/{stream_id}"), 503)
        assert "No space left on device" in still and "brought back" in still and str(tier) not in still, still
        again = client.get(f"/v1/streams/{stream_id}/history")  # within its Retry-After: not tried again
        assert _error(again, 503) == still and again.headers["Retry-After"] in ("4", "5") and len(tries) == 1
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(healing_module, "HEAL_RETRY_SECONDS", 0.0)
        if closed_by == "push":
            _push(client, stream_id, 99, float(index + 1)).raise_for_status()
        else:
            asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 2})
            assert asked.status_code == 200 and asked.json()["frames"] == index + 1, asked.text
        described = client.get(f"/v1/streams/{stream_id}").json()
        assert described["handover"] == "handed over" and not list(tier.rglob("handover.json")), described
        assert described["frames"] == described["pushed"] == index + 1 + (closed_by == "push")
        _push(client, stream_id, 100, float(index + 2)).raise_for_status()
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == index + 2 + (closed_by == "push")
        assert server.service.registry.entries[stream_id] is entry and not server.service.registry.damaged


def _disk_tier_server(short_range, tmp_path):
    """A server of the short-range checkpoint on the disk tier (not started), and its disk tier's folder."""
    checkpoint, qa = short_range
    tier = tmp_path / "tier"
    disk = ModelOptions(model=str(checkpoint), offload="disk", offload_dir=str(tier))
    return Running(tmp_path / "state", qa, options=disk), tier


def _pushed_until_stopped(client, stream_id: str) -> int:
    """Push frames (the handover's moves failing) until the push that meets the stop; returns its index."""
    for index in range(40):
        pushed = _push(client, stream_id, index, float(index))
        if pushed.status_code != 200:
            _error(pushed, 503)
            return index
    pytest.fail("the stream did not hand over")


def test_a_stream_brought_back_after_its_handover_stopped_keeps_its_watches_as_they_stood(short_range, tmp_path,
                                                                                         monkeypatch):
    """A watch evaluated at every frame before the stop comes back with its evaluations and events, and the closed
    stream's watch is closed. Before: the stream was rebuilt from its record on disk (written when the watch was
    made), so the watch came back with none, and the closed stream's watch stayed open. Its folder kept it as the
    handover's checkpoint left it, before the frame the handover stopped in was evaluated: due, it is evaluated
    once as the stream comes back."""
    server, tier = _disk_tier_server(short_range, tmp_path)
    replace = os.replace
    with server, server.client() as client:
        stream_id = _stream(client, frames=0, horizon_frames=None, max_fps=None)
        made = client.post(f"/v1/streams/{stream_id}/watches", json={"question": QUESTION, "every": 1,
                                                                     "max_new_tokens": 2})
        assert made.status_code == 201, made.text
        entry = server.service.registry.entries[stream_id]
        _moves_fail(monkeypatch)
        _pushed_until_stopped(client, stream_id)
        closed, watches = entry.stream, list(entry.stream.watches)
        before = [(watch.id, watch.evaluations, len(watch.events)) for watch in watches]
        assert before[0][1] > 1, before
        monkeypatch.setattr(os, "replace", replace)
        listed = client.get(f"/v1/streams/{stream_id}/watches").json()["data"]
        assert [(watch["id"], watch["evaluations"] - 1) for watch in listed] == [kept[:2] for kept in before]
        assert all(len(watch["events"]) - kept[2] in (0, 1) for watch, kept in zip(listed, before))
        assert entry.stream is not closed and all(watch.closed for watch in watches)


def _bare_registry(qa, tmp_path):
    """A disk-tier server's `StreamRegistry` without the app (so a test can gather its pushes), and its tier."""
    from statekv.serve import ServeConfig
    from statekv.serve.registry import StreamRegistry
    from statekv.serve.worker import ModelWorker

    tier, state = tmp_path / "tier", tmp_path / "state"
    state.mkdir()
    options = ModelOptions(model="tiny", offload="disk", offload_dir=str(tier))
    config = ServeConfig(options=options, state_dir=state, api_keys=(KEY,), page=False, save_every_seconds=600)
    return StreamRegistry(config, qa.with_options(offload="disk", offload_dir=str(tier)), ModelWorker()), tier


async def _stopped(registry, entry) -> dict[int, object]:
    """Pushes queued four at a time until the handover stops: each one's answer (True, or its error)."""
    answers = {}
    for start in range(0, 40, 4):
        got = await asyncio.gather(*[registry.push(entry, _frame(index), float(index))
                                     for index in range(start, start + 4)], return_exceptions=True)
        answers.update(zip(range(start, start + 4), got))
        if any(answer is not True for answer in got):
            return answers
    pytest.fail("the stream did not hand over")


def test_pushes_queued_across_a_stopped_handover_answer_503_never_400_and_a_replica_brings_back_every_frame(
        short_range, tmp_path, monkeypatch):
    """Pushes queued behind the one that meets the stop (each queued without waiting for the one before), and one
    that waited while the stream could not be brought back yet, answer 503 (not streamed: retry), never 400; on a
    replica (whose loader resumes no disk-tier folder at start) the stream comes back from its own folder, handed
    over, with every frame taken, and each refused frame pushed again is taken once. Before: those pushes were 400
    ("this stream was closed"), and a replica brought the stream back empty in a new folder, answering 200."""
    import statekv.serve.healing as healing_module
    from statekv.serve.errors import ServiceError

    registry, tier = _bare_registry(short_range[1], tmp_path)
    registry.loader.resume_tiers = False  # as a replica's (LeasedPlacement)
    monkeypatch.setattr(healing_module, "HEAL_RETRY_SECONDS", 0.0)
    replace = os.replace
    _moves_fail(monkeypatch)

    async def main() -> None:
        entry = await registry.create(KEY, {"max_fps": None})
        answers = await _stopped(registry, entry)
        answers[99] = (await asyncio.gather(registry.heal(entry), registry.push(entry, _frame(99), 99.0),
                                            return_exceptions=True))[1]
        shown = {index: answer if answer is True else (getattr(answer, "status", None), str(answer)[:90])
                 for index, answer in answers.items()}
        assert all(answer is True or isinstance(answer, ServiceError) and answer.status == 503
                   for answer in answers.values()), shown
        stopped = [index for index, answer in answers.items() if "do not push this frame again" in str(answer)]
        refused = [index for index, answer in answers.items() if answer is not True and index not in stopped]
        assert len(stopped) == 1 and 99 in refused and len(refused) > 1, shown
        monkeypatch.setattr(os, "replace", replace)
        await registry.heal(entry)
        stream = entry.stream
        assert stream.handover == "handed over" and stream.pushed == len(answers) - len(refused), shown
        assert stream.last_timestamp == float(stopped[0])
        assert [path.name for path in tier.iterdir()] == [entry.tier.name]  # its own folder, no new one
        for index in refused:
            assert await registry.push(entry, _frame(index), float(index)) is True
        assert entry.stream.pushed == len(answers)

    try:
        asyncio.run(main())
    finally:
        registry.close_all()
        registry.worker.close()


def test_a_stream_found_damaged_as_it_is_brought_back_is_quarantined_once_for_every_holder(short_range, tmp_path,
                                                                                         monkeypatch):
    """The folder of a stream closed by its stopped handover is damaged (its handover.json) before it is brought
    back: the request bringing it back answers 409, and so does a push that waited for it; one that waited to bring
    it back does not try again (its file set moved into the quarantine once); the entry is deleted for whoever
    still holds it (`/events`, the page) and the closed stream's watch is closed. Before: the waiting push was
    400 ("this stream was closed"), the second request quarantined it again, and the entry and watch stayed."""
    registry, tier = _bare_registry(short_range[1], tmp_path)
    replace = os.replace
    _moves_fail(monkeypatch)

    async def main() -> None:
        entry = await registry.create(KEY, {"max_fps": None})
        watch = await registry.worker.run(entry.stream.watch, QUESTION, 1, max_new_tokens=2)
        await _stopped(registry, entry)
        monkeypatch.setattr(os, "replace", replace)
        (entry.tier / "handover.json").write_text("{}")
        got = await asyncio.gather(registry.heal(entry), registry.push(entry, _frame(99), 99.0), registry.heal(entry),
                                   return_exceptions=True)
        assert [getattr(answer, "status", answer) for answer in got] == [409, 409, None], got
        assert "damaged" in str(got[1]) and entry.deleted and watch.closed and entry.id in registry.damaged
        assert entry.id not in registry.entries and len(registry.files.quarantined(entry.id)) == 1

    try:
        asyncio.run(main())
    finally:
        registry.close_all()
        registry.worker.close()


def test_a_stream_brought_back_having_lost_frames_refuses_its_next_push_once_saying_where_to_resume(
        short_range, tmp_path, monkeypatch):
    """Frames that waited for their step when the handover stopped are lost as the stream comes back (its resume
    counts them: `frames_lost`, made 2 here, since a served stream steps each frame as it is pushed): its next push
    is refused once (409, naming ``resume_from``), as for a stream a replica took from its last save, and the one
    after is taken. Before: the push was taken, the client never told that frames were lost."""
    registry, tier = _bare_registry(short_range[1], tmp_path)
    replace = os.replace
    _moves_fail(monkeypatch)
    restore_one = registry.restore_one

    def losing(*args):
        healed = restore_one(*args)
        healed.stream.frames_lost = 2
        return healed

    async def main() -> None:
        entry = await registry.create(KEY, {"max_fps": None})
        await _stopped(registry, entry)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(registry, "restore_one", losing)
        await registry.heal(entry)
        pushed = entry.stream.pushed
        with pytest.raises(Exception) as refused:
            await registry.push(entry, _frame(99), 99.0)
        assert refused.value.status == 409 and f"push again from frame {pushed} (resume_from)" in str(refused.value)
        assert await registry.push(entry, _frame(99), 99.0) is True and entry.stream.pushed == pushed + 1

    try:
        asyncio.run(main())
    finally:
        registry.close_all()
        registry.worker.close()


def _frame(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)


def test_streams_without_a_horizon_come_back_after_a_restart_not_quarantined(qa, tmp_path):
    """Before: the record check wanted a horizon, so every stream made without one (the default since issue 34)
    was listed as damaged after a restart."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        ids = [_stream(client, seed=0, horizon_frames=None)]
        created = client.post("/v1/streams", json={})  # the server's default: no horizon
        assert created.status_code == 201 and created.json()["horizon_frames"] is None, created.text
        ids.append(created.json()["id"])
        _push(client, ids[1], 7, 0.0).raise_for_status()
    with Running(state, qa) as server, server.client() as client:
        listed = {entry["id"]: entry for entry in client.get("/v1/streams").json()["data"]}
        assert all(listed[i].get("state") != "damaged" and "damaged" not in listed[i] for i in ids), listed
        assert [client.get(f"/v1/streams/{i}").json()["frames"] for i in ids] == [2, 1]
        _push(client, ids[1], 8, 1.0).raise_for_status()


def _files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_a_disk_tier_file_set_that_cannot_be_resumed_is_moved_to_quarantine_and_its_stream_kept_damaged(
        qa, tmp_path, options, caplog):
    """Before: a file set that could not be resumed was left where it was and the stream served from its last save
    (the pushes journaled since then silently gone), in a new file set beside the old one."""
    from statekv.core.disk.files import hold

    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id, kept_id = _stream(client, frames=3), _stream(client, frames=1, seed=20)
    folder = next(path for path in tier.iterdir() if json.loads(
        (state / "streams" / f"{stream_id}.json").read_text())["tier"] == path.name)

    lock = hold(folder, "another server")  # in use by a live process: not this server's to move
    try:
        with Running(state, qa, options=disk) as server, server.client() as client:
            reason = {s["id"]: s for s in client.get("/v1/streams").json()["data"]}[stream_id]["damaged"]
            assert "in use" in reason and "left where it is" in reason and str(tier) not in reason
            assert "damaged" in _error(client.get(f"/v1/streams/{stream_id}"), 409)
            assert client.get(f"/v1/streams/{kept_id}").json()["frames"] == 1  # the others are served
    finally:
        lock.release()
    assert folder.is_dir() and not list(state.glob("quarantine/st_*-*"))
    with Running(state, qa, options=disk) as server, server.client() as client:  # tried again: it resumes
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 3
        assert not (state / "quarantine" / f"{stream_id}.json").exists()  # its note gone with the damage

    (folder / "stream.json").write_text("{}")  # the file set damaged
    before = _files(folder)
    caplog.clear()
    with Running(state, qa, options=disk) as server, server.client() as client:
        listed = {s["id"]: s for s in client.get("/v1/streams").json()["data"]}
        assert listed[stream_id]["state"] == "damaged" and listed[kept_id]["frames"] == 1
        reason = listed[stream_id]["damaged"]
        (moved,) = state.glob(f"quarantine/{stream_id}-*")
        assert f"{folder.name} cannot be resumed" in reason and f"moved to quarantine/{moved.name}" in reason
        assert str(tmp_path) not in reason and "\n" not in reason
        for reply in (client.get(f"/v1/streams/{stream_id}"), _push(client, stream_id, 5, 9.0),
                      client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION})):
            assert reason in _error(reply, 409)
    logged = [r.getMessage() for r in caplog.records if stream_id in r.getMessage() and "quarantine/" in r.getMessage()]
    assert len(logged) == 1, logged  # one line says what was moved where, and why
    assert not folder.exists() and _files(moved) == before  # moved whole, nothing changed or deleted
    assert [path.name for path in tier.iterdir()] == [json.loads(  # no new file set made for it
        (state / "streams" / f"{kept_id}.json").read_text())["tier"]]

    with Running(state, qa, options=disk) as server, server.client() as client:  # a restart keeps it so
        listed = {s["id"]: s for s in client.get("/v1/streams").json()["data"]}
        assert listed[stream_id]["state"] == "damaged" and listed[stream_id]["damaged"] == reason
        assert list(state.glob(f"quarantine/{stream_id}-*")) == [moved] and _files(moved) == before
        assert len(list(tier.iterdir())) == 1
        assert client.delete(f"/v1/streams/{stream_id}").status_code == 200  # its owner removes it all
        assert not list(state.glob(f"quarantine/{stream_id}*")) and not list(state.glob(f"streams/{stream_id}*"))
        assert _error(client.get(f"/v1/streams/{stream_id}"), 404)
        assert client.get(f"/v1/streams/{kept_id}").json()["frames"] == 1


def test_long_names_deep_json_and_short_pngs_are_one_line_4xx_on_a_kept_connection(qa, tmp_path):
    """Before: a very long source name and a deeply nested JSON body were 500s (the connection dropped), and so was
    a lone surrogate escaped in a name or a question (a stream so named was made, its id never answered); a PNG
    whose header promises more rows than it holds was streamed, its missing rows black."""
    media = tmp_path / "media"
    media.mkdir()
    with Running(tmp_path / "state", qa, media_root=media) as server, server.client() as client:
        stream_id = _stream(client, frames=1)
        for source in ("a" * 5000, "/".join(["b" * 250] * 30), "c" * 300 + ".mp4"):
            reply = client.post(f"/v1/streams/{stream_id}/frames", json={"source": source})
            assert source not in _error(reply, 400, 404)
        deep = ("[" * 100_000) + ("]" * 100_000)
        for path in ("/v1/streams", f"/v1/streams/{stream_id}/ask", "/v1/chat/completions"):
            reply = client.post(path, content=deep, headers={"Content-Type": "application/json"})
            assert "nested too deeply" in _error(reply, 400)
        half = '"\\ud800"'  # a lone surrogate, escaped: JSON takes it, no text holds it
        bodies = {"/v1/streams": '{"name": %s}', f"/v1/streams/{stream_id}/ask": '{"question": %s}',
                  f"/v1/streams/{stream_id}/watches": '{"question": %s, "every": 1}'}
        for path, body in bodies.items():
            reply = client.post(path, content=body % half, headers={"Content-Type": "application/json"})
            assert "lone surrogate" in _error(reply, 400)
        assert [s["id"] for s in client.get("/v1/streams").json()["data"]] == [stream_id]  # no stream made
        short = _short_png(rows_held=16, rows_promised=32)
        assert np.asarray(Image.open(io.BytesIO(short)).convert("RGB")).shape == (32, 32, 3)  # PIL fills it in
        message = _error(client.post(f"/v1/streams/{stream_id}/frames?t=3", content=short,
                                     headers={"Content-Type": "image/png"}), 400)
        assert "promises 32 rows" in message
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 1  # nothing streamed
        assert client.get("/health").status_code == 200  # the same client, its connection kept


def test_a_named_pipe_under_the_media_root_is_a_400_saying_so(qa, tmp_path):
    """Before: a named pipe (or a device's node) under the media root was a 404, "no such file"."""
    media = tmp_path / "media"
    media.mkdir()
    os.mkfifo(media / "camera.mp4")
    with Running(tmp_path / "state", qa, media_root=media) as server, server.client() as client:
        stream_id = _stream(client, frames=1)
        reply = client.post(f"/v1/streams/{stream_id}/frames", json={"source": "camera.mp4"})
        assert "is not a regular file (a named pipe" in _error(reply, 400)
        assert "no such file" in _error(client.post(f"/v1/streams/{stream_id}/frames", json={"source": "gone.mp4"}),
                                        404)


def test_a_stream_that_cannot_close_is_still_deleted_and_stays_deleted_after_a_restart(qa, tmp_path, monkeypatch):
    """Before: a close that failed (say the disk tier's last checkpoint on a full disk) left the stream's record
    and files behind while the stream was gone from memory, so a restart brought the deleted stream back."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        stream_id = _stream(client, frames=1)
        entry = server.service.registry.entries[stream_id]

        def failing_close():
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(entry.stream, "close", failing_close)
        assert client.delete(f"/v1/streams/{stream_id}").status_code == 200
        assert not list((state / "streams").glob(f"{stream_id}*"))
    with Running(state, qa) as server, server.client() as client:
        assert stream_id not in {s["id"] for s in client.get("/v1/streams").json()["data"]}


# ---------------------------------------------------------------------------------------------------------------
# Deletions that hold, records that describe their saves, a state folder that cannot be written (issue 51)
# ---------------------------------------------------------------------------------------------------------------
def _refusing_writes_under(folder: Path, monkeypatch, number: int = errno.EROFS) -> None:
    """As a read-only (or full) filesystem under ``folder``: nothing is made, written, renamed or removed there."""
    def refusing(real, writes):
        def call(path, *args, **kwargs):
            if str(path).startswith(str(folder)) and writes(path, args, kwargs):
                raise OSError(number, os.strerror(number), str(path))
            return real(path, *args, **kwargs)
        return call

    always = lambda path, args, kwargs: True  # noqa: E731
    written = lambda path, args, kwargs: any(c in (args[0] if args else kwargs.get("mode", "r")) for c in "wxa+")  # noqa: E731
    for name in ("unlink", "rename", "replace", "rmdir", "mkdir", "link"):
        monkeypatch.setattr(os, name, refusing(getattr(os, name), always))
    monkeypatch.setattr(os, "open", refusing(os.open, lambda path, args, kwargs: args[0] & (
        os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
    import builtins

    monkeypatch.setattr(builtins, "open", refusing(builtins.open, written))
    monkeypatch.setattr(io, "open", refusing(io.open, written))


def _filling(monkeypatch) -> None:
    """As a disk that fills while a file is written: it opens, and its flush to the disk fails."""
    def full(handle):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)


@pytest.mark.parametrize("number, filling", [(errno.EROFS, False), (errno.ENOSPC, False), (errno.ENOSPC, True)],
                         ids=["read-only", "disk full", "filling as written"])
def test_a_state_folder_that_cannot_be_written_refuses_changes_in_one_line_and_keeps_every_stream(
        qa, tmp_path, monkeypatch, number, filling):
    """Before: DELETE answered 500 with a raw OSError, the stream then answered 404 though its files stayed, and a
    restart brought the deleted stream back; a disk filling as the deletion's note was written left the note's
    partial file behind."""
    state = tmp_path / "state"
    with Running(state, qa, save_every_frames=2) as server, server.client() as client:
        kept = _stream(client, frames=2)
        before = _files(state / "streams")
        with monkeypatch.context() as patched:
            if filling:
                _filling(patched)
            else:
                _refusing_writes_under(state, patched, number)
            for response, status in ((client.delete(f"/v1/streams/{kept}"), 503),
                                     (client.post("/v1/streams", json={}), 503),
                                     (_push(client, kept, 5, 5.0), 503)):  # its save is due: refused, unstreamed
                message = _error(response, status)
                assert os.strerror(number) in message and str(tmp_path) not in message, message
            assert "nothing was deleted" in _error(client.delete(f"/v1/streams/{kept}"), 503)
            assert client.get(f"/v1/streams/{kept}").json()["frames"] == 2  # still served, as it was
            answered = client.post(f"/v1/streams/{kept}/ask", json={"question": QUESTION, "max_new_tokens": 4})
            assert answered.status_code == 200  # its note in the record is lost, the answer is not
            assert [s["id"] for s in client.get("/v1/streams").json()["data"]] == [kept]
        assert _files(state / "streams") == before  # nothing half-written, nothing removed
        assert client.delete(f"/v1/streams/{kept}").status_code == 200  # once it can be written again
    with Running(state, qa) as server, server.client() as client:
        assert client.get("/v1/streams").json()["data"] == []
        assert client.get(f"/v1/streams/{kept}").status_code == 404
    assert not list((state / "streams").iterdir())


def test_a_deletion_cut_short_is_finished_at_the_next_start_never_brought_back(qa, tmp_path, monkeypatch):
    """Before: a deletion stopped between removing the save and the record (a kill, a file that would not go)
    left the record, so a restart served the deleted stream again, empty."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
        client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 2})  # saved
        record = state / "streams" / f"{stream_id}.json"
        real = Path.unlink

        def stopped(path, *args, **kwargs):  # the deletion stops before its record goes
            if path == record:
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
            return real(path, *args, **kwargs)

        with monkeypatch.context() as patched:
            patched.setattr(Path, "unlink", stopped)
            assert client.delete(f"/v1/streams/{stream_id}").status_code == 200
        assert record.exists()  # cut short
        assert client.get(f"/v1/streams/{stream_id}").status_code == 404
    with Running(state, qa) as server, server.client() as client:
        assert client.get("/v1/streams").json()["data"] == []
        assert client.get(f"/v1/streams/{stream_id}").status_code == 404
    assert not list((state / "streams").iterdir())  # finished


@pytest.mark.parametrize("edit", ["smaller horizon", "another frame rate", "more frames saved"])
def test_a_record_that_does_not_describe_its_save_is_not_served(qa, tmp_path, edit):
    """Before: a record edited to a smaller horizon was served with it (and a push past it accepted); nothing
    compared a record with the save it describes."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        edited, intact = _stream(client, frames=3), _stream(client, frames=2, seed=10)
    path = state / "streams" / f"{edited}.json"
    record = json.loads(path.read_text())
    if edit == "smaller horizon":
        record["horizon_frames"] = 4
    elif edit == "another frame rate":
        record["max_fps"] = 30.0
    else:
        record["saved"] = {**record["saved"], "frames": 9, "pushed": 9}
    path.write_text(json.dumps(record))
    with Running(state, qa) as server, server.client() as client:
        listed = {s["id"]: s for s in client.get("/v1/streams").json()["data"]}
        assert listed[edited]["state"] == "damaged", listed[edited]
        assert ("horizon_frames" if "horizon" in edit else "max_fps" if "rate" in edit else "saved") in \
            listed[edited]["damaged"]
        assert _error(_push(client, edited, 7, 7.0), 409)
        assert listed[intact]["state"] == "ready" and client.get(f"/v1/streams/{intact}").json()["frames"] == 2


@pytest.mark.parametrize(("setting", "value", "made_as"), [("positions", "bounded", "stream"),
                                                        ("kv_cache_dtype", "int8", None)])
def test_a_server_restarted_with_another_binding_setting_serves_each_stream_as_it_was_made(setting, value, made_as,
                                                                                          qa, tmp_path, options):
    """Before: a stream made under the default positions (the paper's, its horizon fitting the model) was listed as
    damaged by a server restarted with --positions bounded, though nothing of it was wrong; and every saved stream
    by one restarted with --kv-cache-dtype int8 ("load it with kv_cache_dtype=auto", which no client can do). Each
    stream keeps what it was made with; new streams take the server's setting."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        stream_id = _stream(client, frames=3)
        first = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 6}).json()
    changed = options.with_changes(**{setting: value})
    with Running(state, qa.with_options(**{setting: value}), options=changed) as server, server.client() as client:
        assert [(s["id"], s["state"]) for s in client.get("/v1/streams").json()["data"]] == [(stream_id, "ready")]
        again = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 6})
        assert again.json()["answer"] == first["answer"]
        _push(client, stream_id, 3, 3.0).raise_for_status()
        made = _stream(client, frames=2)
        entries = server.service.registry.entries
        assert getattr(entries[made].stream.engine, setting) == value
        assert getattr(entries[stream_id].stream.engine, setting) == made_as
    with Running(state, qa) as server, server.client() as client:
        listed = {(s["id"], s["state"], s["frames"]) for s in client.get("/v1/streams").json()["data"]}
        assert listed == {(stream_id, "ready", 4), (made, "ready", 2)}
        assert getattr(server.service.registry.entries[made].stream.engine, setting) == value


def test_a_start_without_the_disk_tier_quarantines_a_killed_disk_tier_stream_until_one_with_it(
        qa, tmp_path, options, monkeypatch, caplog):
    """Before: a server started after a kill without --offload disk served a disk-tier stream from its last save,
    dropped without a word the frames journaled since, and wrote its record without its file set, so that no later
    start found them (and one started with another --offload-dir said nothing of them either). After a clean stop
    too its frames are in its file set alone (its saves make the file set durable, copying nothing): a start
    without the disk tier lists it as damaged, naming the flags that serve it."""
    import statekv.core.disk.tier

    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 1)
    tier, state, killed = tmp_path / "tier", tmp_path / "state", tmp_path / "state-killed"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk, save_every_frames=100) as server, server.client() as client:
        stream_id = _stream(client, frames=4, horizon_frames=None)
        shutil.copytree(state, killed)  # what a kill leaves: the steps journaled, no save
        shutil.copytree(tier, tmp_path / "tier-killed")
    shutil.copytree(killed, tmp_path / "state-elsewhere")
    with Running(killed, qa, options=options) as server, server.client() as client:
        listed = {s["id"]: s for s in client.get("/v1/streams").json()["data"]}
        assert listed[stream_id]["state"] == "damaged" and "--offload disk" in listed[stream_id]["damaged"], listed
    elsewhere = options.with_changes(offload="disk", offload_dir=str(tmp_path / "elsewhere"))
    with Running(tmp_path / "state-elsewhere", qa, options=elsewhere) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 0  # its last save's
        assert "in a new file set, without the frames journaled in" in caplog.text
    back = options.with_changes(offload="disk", offload_dir=str(tmp_path / "tier-killed"))
    with Running(killed, qa, options=back) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 4
    with Running(state, qa, options=disk, save_every_frames=100) as server, server.client() as client:
        _push(client, stream_id, 4, 4.0).raise_for_status()  # going on after a clean stop: its mark is gone
        shutil.copytree(state, tmp_path / "state-again")  # a kill
    with Running(tmp_path / "state-again", qa, options=options) as server, server.client() as client:
        assert client.get("/v1/streams").json()["data"][0]["state"] == "damaged"
    with Running(state, qa, options=options) as server, server.client() as client:
        listed = client.get("/v1/streams").json()["data"][0]
        assert listed["state"] == "damaged" and "kept in its disk-tier file set" in listed["damaged"], listed
        assert "start the server with --offload disk and the --offload-dir" in listed["damaged"]
    assert not list((state / "streams").glob("*.safetensors"))  # its saves wrote no copy of its cache
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 5


def test_a_disk_tier_streams_saves_write_no_copy_of_its_cache_and_a_restart_resumes_it_whole(qa, tmp_path,
                                                                                                options):
    """Before: every save of a disk-tier stream wrote a whole copy of its detailed cache into the state folder,
    although its file set holds every push: the bytes of each save grew with the stream's age. Its saves now make
    its file set durable and write its record alone, and a restart resumes it in its file set, bit-exactly."""
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    streams, written = state / "streams", []

    def held() -> int:
        return sum(path.stat().st_size for path in streams.iterdir() if path.is_file())

    images = [np.asarray(Image.open(io.BytesIO(_png(seed))).convert("RGB")) for seed in range(13)]
    with Running(state, qa, options=disk, save_every_frames=4) as server, server.client() as client:
        stream_id = _stream(client, frames=0, max_fps=1.0)
        for index in range(12):
            if index in (4, 8):  # each push saves the stream first
                written.append(held())
            _push(client, stream_id, index, float(index)).raise_for_status()
            if index in (4, 8):
                written[-1] = held() - written[-1]
        assert client.get(f"/v1/streams/{stream_id}").json()["saved"]["frames"] == 8
    assert not list(streams.glob("*.safetensors")) and max(written) < 4096, written  # its record alone
    assert json.loads((streams / f"{stream_id}.json").read_text())["tier_saved"] is True
    elsewhere = options.with_changes(offload="disk", offload_dir=str(tmp_path / "elsewhere"))
    with Running(state, qa, options=elsewhere) as server, server.client() as client:  # no save to serve it from
        listed = client.get("/v1/streams").json()["data"][0]
        assert listed["state"] == "damaged" and "is not in --offload-dir" in listed["damaged"], listed
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 12
        _push(client, stream_id, 12, 12.0).raise_for_status()
        answer = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 6})
    alone = qa.stream(16, max_fps=1.0)
    for index, image in enumerate(images):
        alone.push(image, float(index))
    assert answer.json()["answer"] == alone.ask(QUESTION, max_new_tokens=6)


def test_a_disk_tier_stream_kept_in_its_file_set_alone_is_deleted_only_where_its_file_set_is_reached(qa, tmp_path,
                                                                                                        options):
    """Before: a server started without --offload disk listed such a stream as damaged and deleted it (200) by its
    record alone, leaving its file set, every frame of it, in --offload-dir for good: no start removed it."""
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
    with Running(state, qa, options=options) as server, server.client() as client:
        assert "--offload disk" in _error(client.delete(f"/v1/streams/{stream_id}"), 409)
        assert client.get("/v1/streams").json()["data"][0]["state"] == "damaged"
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert client.delete(f"/v1/streams/{stream_id}").status_code == 200
    assert not [path for path in tier.iterdir() if path.is_dir()]


def test_a_start_with_another_setup_leaves_disk_tier_file_sets_where_they_are_for_a_start_with_theirs(qa, tmp_path,
                                                                                                     options):
    """Before: a start with another model, layout, dtype or method than the streams were saved with (a mistyped
    flag) moved every disk-tier stream's sound file set into the quarantine, and a start with the right flags then
    still listed each as damaged until its folder was moved back by hand. Then its 409 said to repair its files, kept
    "in the state folder" (they are sound, in --offload-dir), or delete the stream."""
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
    file_sets = sorted(path.name for path in tier.iterdir())
    other = disk.with_changes(dtype="bfloat16")
    with Running(state, statekv.VideoQA.from_options(other), options=other) as server, server.client() as client:
        listed = client.get("/v1/streams").json()["data"]
        assert [stream["state"] for stream in listed] == ["damaged"]
        assert "saved with another setup" in str(listed[0]) and "left where it is" in str(listed[0]), listed
        refused = _error(client.get(f"/v1/streams/{stream_id}"), 409)  # before: "repair them and restart"
        assert "repair" not in refused and "its files are sound" in refused and "start the server with" in refused
    assert sorted(path.name for path in tier.iterdir()) == file_sets and not list(state.glob("quarantine/*-*"))
    with Running(state, qa, options=disk) as server, server.client() as client:
        info = client.get(f"/v1/streams/{stream_id}").json()
        assert info["state"] == "ready" and info["frames"] == 2, info


def test_a_stream_deleted_by_a_start_with_another_setup_takes_its_file_set_with_it(qa, tmp_path, options):
    """Before: a start with another setup listed the stream as damaged, its file set left in --offload-dir, and a
    DELETE there answered 200 and removed its record alone: the file set, every frame of it, stayed in
    --offload-dir for good, no start removing it, no log line naming it."""
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
    assert [path for path in tier.iterdir() if path.is_dir()]
    other = disk.with_changes(dtype="bfloat16")
    with Running(state, statekv.VideoQA.from_options(other), options=other) as server, server.client() as client:
        assert client.get("/v1/streams").json()["data"][0]["state"] == "damaged"
        file_set = next(path for path in tier.iterdir() if path.is_dir())
        held = hold(file_set, "another process")  # while it is held, nothing is deleted
        try:
            assert "nothing was deleted" in _error(client.delete(f"/v1/streams/{stream_id}"), 409)
        finally:
            held.release()
        assert file_set.is_dir() and client.get("/v1/streams").json()["data"][0]["state"] == "damaged"
        assert client.delete(f"/v1/streams/{stream_id}").status_code == 200
        assert client.get("/v1/streams").json()["data"] == []
    assert not [path for path in tier.iterdir() if path.is_dir()]
    assert not list((state / "streams").iterdir())


def test_a_disk_tier_stream_whose_file_set_is_in_the_quarantine_or_elsewhere_is_deleted_and_says_so(qa, tmp_path,
                                                                                                   options, caplog):
    """A file set moved into the state folder's quarantine is reached by every server, so its stream is deleted
    there, files and all (the first version of the 409 refused it); one not in --offload-dir is deleted by its record,
    with a warning naming the file set, which may be elsewhere."""
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        damaged, elsewhere = _stream(client, frames=2), _stream(client, frames=2, seed=10)
    records = {stream_id: json.loads((state / "streams" / f"{stream_id}.json").read_text())
               for stream_id in (damaged, elsewhere)}
    (tier / records[damaged]["tier"] / "stream.json").write_text("{}")
    shutil.move(tier / records[elsewhere]["tier"], tmp_path / records[elsewhere]["tier"])
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert {stream["state"] for stream in client.get("/v1/streams").json()["data"]} == {"damaged"}
    assert list(state.glob(f"quarantine/{damaged}-*"))
    with Running(state, qa, options=options) as server, server.client() as client:
        assert client.delete(f"/v1/streams/{damaged}").status_code == 200
    assert not list(state.glob(f"quarantine/{damaged}-*"))
    with caplog.at_level(logging.WARNING, logger="statekv.serve"):
        with Running(state, qa, options=disk) as server, server.client() as client:
            assert client.delete(f"/v1/streams/{elsewhere}").status_code == 200
    said = [r.getMessage() for r in caplog.records if "remove it by hand" in r.getMessage()]
    assert len(said) == 1 and records[elsewhere]["tier"] in said[0] and str(tier) in said[0], said


def test_a_disk_tier_stream_whose_creation_a_kill_cut_short_leaves_no_file_set(qa, tmp_path, options, caplog,
                                                                                monkeypatch):
    """Before: a kill after a disk-tier stream's file set was made and before its record was written left a file
    set that no record named: no deletion reached it, and kills over weeks piled them up. The next start removes
    it, also when the kill came before the file set described its stream, and a note that a kill cut short
    mid-write; the streams made whole keep theirs, and another server's notes in a shared folder (or a note that is
    no note) are left as they are."""
    from statekv.serve.store import StreamFiles

    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    claim = StreamFiles.claim

    def killed_here(files, stream_id):  # what a kill at this point leaves
        shutil.copytree(state, tmp_path / "state-killed")
        shutil.copytree(tier, tmp_path / "tier-killed")
        return claim(files, stream_id)

    with Running(state, qa, options=disk) as server, server.client() as client:
        kept = _stream(client, frames=2)
        monkeypatch.setattr(StreamFiles, "claim", killed_here)
        assert client.post("/v1/streams", json={}).status_code == 201
        monkeypatch.setattr(StreamFiles, "claim", claim)
    file_sets = [path for path in (tmp_path / "tier-killed").iterdir() if path.is_dir()]
    assert len(file_sets) == 2
    for name in ("state", "tier"):
        shutil.rmtree(tmp_path / name)
        (tmp_path / f"{name}-killed").rename(tmp_path / name)
    orphan = next(path for path in tier.iterdir() if path.is_dir() and kept not in (path / "stream.json").read_text())
    (orphan / "stream.json").unlink()  # a kill before the file set described its stream
    others = {tier / f".creating-st_{'0' * 24}.json": {"id": f"st_{'0' * 24}", "state": "another server", "at": 0},
              tier / f".creating-st_{'1' * 24}.json": [1]}
    for path, note in others.items():
        path.write_text(json.dumps(note))
    cut, writing = tier / f".creating-{kept}.json.0badcafe.partial", tier / f".creating-{kept}.json.12345678.partial"
    for partial in (cut, writing):  # a kill mid-write left one; another server is writing the other
        partial.write_text("{")
    os.utime(cut, (0, 0))
    (tier / "elsewhere").mkdir()
    (tier / "elsewhere" / "stream.json").write_text(json.dumps({"stream_id": f"st_{'0' * 24}"}))
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert [listed["id"] for listed in client.get("/v1/streams").json()["data"]] == [kept]
        assert "whose creation a stop cut short" in caplog.text
        assert client.delete(f"/v1/streams/{kept}").status_code == 200
    assert sorted(path.name for path in tier.iterdir()) == sorted(["elsewhere", writing.name,
                                                                   *(path.name for path in others)])


@pytest.mark.parametrize("unrecorded", [False, True])
def test_a_start_that_a_kill_cut_short_while_it_loaded_a_stream_into_a_new_file_set_leaves_no_file_set(
        qa, tmp_path, options, caplog, monkeypatch, unrecorded):
    """Before: a start that loaded a stream from its save into a new disk-tier file set (its own lost with a disk)
    and was killed before the record named the new one left that file set for good: the stream's record named
    another, and each such start and kill made one more. ``unrecorded``: the record could not be written then
    (logged, the stream served), and the kill came later."""
    from statekv.serve.entries import StreamEntry

    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        kept = _stream(client, frames=2)

    def file_sets():
        return sorted(path.name for path in tier.iterdir() if path.is_dir())

    record = state / "streams" / f"{kept}.json"  # as saved whole before saves made its file set durable instead
    whole = statekv.Stream.load(tier / file_sets()[0], qa.with_options(offload="disk", offload_dir=str(tier)),
                                stream_id=kept, owner=json.loads(record.read_text())["owner"])
    whole.save(state / "streams" / f"{kept}.safetensors")
    whole.close()
    record.write_text(json.dumps({**json.loads(record.read_text()), "tier_saved": False}))
    shutil.rmtree(tier / file_sets()[0])  # lost with its disk: the next start loads it from its save
    write_record = StreamEntry.write_record

    def killed_here(entry, files):  # what a kill as the record is written leaves
        if not (tmp_path / "state-killed").exists():
            shutil.copytree(state, tmp_path / "state-killed")
            shutil.copytree(tier, tmp_path / "tier-killed")
        return write_record(entry, files)

    def refused(entry, files):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(StreamEntry, "write_record", refused if unrecorded else killed_here)
    with Running(state, qa, options=disk):
        if unrecorded:  # a kill later on
            shutil.copytree(state, tmp_path / "state-killed")
            shutil.copytree(tier, tmp_path / "tier-killed")
    monkeypatch.setattr(StreamEntry, "write_record", write_record)
    for name in ("state", "tier"):
        shutil.rmtree(tmp_path / name)
        (tmp_path / f"{name}-killed").rename(tmp_path / name)
    assert len(file_sets()) == 1  # the load's, which the record does not name
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert client.get(f"/v1/streams/{kept}").json()["frames"] == 2
        assert "made by a load that did not finish" in caplog.text
    assert len(file_sets()) == 1 and f".creating-{kept}.json" not in os.listdir(tier)
    assert json.loads((state / "streams" / f"{kept}.json").read_text())["tier"] == file_sets()[0]


def test_a_streams_window_and_retrieval_are_set_over_http_and_kept_across_restarts(qa, tmp_path, options):
    """Before: a client could not set SimpleStream's window nor the retrieval rule ("unknown stream setting"),
    and a stream took the server's, so a restart with other --window or --retrieval changed its answers."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        recent = client.post("/v1/streams", json={"method": "simplestream", "window": 3})
        assert recent.status_code == 201 and recent.json()["settings"] == {"method": "simplestream", "window": 3,
                                                                             "retrieve": None}, recent.text
        ruled = client.post("/v1/streams", json={"retrieve": 2, "retrieval": "recent"})
        assert ruled.status_code == 201 and ruled.json()["settings"]["retrieval"] == "recent", ruled.text
        alone = client.post("/v1/streams", json={"retrieval": "recent"})  # the rule of questions that retrieve
        assert alone.status_code == 201, alone.text
        again = client.post("/v1/streams", json=alone.json()["settings"])  # settings read back make it again
        assert again.status_code == 201 and again.json()["settings"] == alone.json()["settings"], again.text
        assert "window" in _error(client.post("/v1/streams", json={"method": "statekv", "window": 3}), 400)
        assert "retrieval" in _error(client.post("/v1/streams", json={"method": "simplestream",
                                                                       "retrieval": "recent"}), 400)
        assert "retrieval" in _error(client.post("/v1/streams", json={"retrieval": "nearest"}), 400)
        made = {"recent": recent.json()["id"], "ruled": ruled.json()["id"]}
    other = options.with_changes(window=5, retrieval="rekv")
    with Running(state, qa.with_options(window=5, retrieval="rekv"), options=other) as server:
        entries = server.service.registry.entries
        assert entries[made["recent"]].stream.qa.recent_window == 3
        assert entries[made["ruled"]].stream.qa.options.retrieval_rule == "recent"


# ---------------------------------------------------------------------------------------------------------------
# Questions refused with the status their plain route answers, watches that could not be kept, uploads left over
# ---------------------------------------------------------------------------------------------------------------
def _events(client, path: str, body: dict) -> tuple[int, list[dict]]:
    with client.stream("POST", path, json=body) as reply:
        status = reply.status_code
        lines = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    return status, lines


def test_a_question_too_long_for_the_models_range_is_a_413_on_every_route(qa, tmp_path):
    """Before: on a stream with no horizon (bounded positions) it was a 409 (its streamed answer's error event said
    400), while the same question on a stream with a horizon was the documented 413. Streamed, the reply was then
    a 200 whose one event was the 413: the status now waits for the answer's generation to begin."""
    wordy = "1," * 3900  # under 8,000 characters, 7,800 tokens: past the built-in model's 4,096 positions
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        created = client.post("/v1/streams", json={})
        stream_id = created.json()["id"]
        _push(client, stream_id, 0, 0.0).raise_for_status()
        ask = f"/v1/streams/{stream_id}/ask"
        message = _error(client.post(ask, json={"question": wordy}), 413)
        assert re.match(r"the question is \d+ tokens and its answer up to 64: .*positions", message), message
        assert _error(client.post(ask, json={"question": wordy, "stream": True}), 413) == message
        chat = {"messages": [{"role": "user", "content": wordy}], "statekv": {"stream_id": stream_id}}
        assert _error(client.post("/v1/chat/completions", json=chat), 413) == message
        assert _error(client.post("/v1/chat/completions", json={**chat, "stream": True}), 413) == message
        status, pieces = _events(client, ask, {"question": QUESTION, "stream": True})  # the stream still answers
        assert status == 200 and "answer" in pieces[-1], pieces


def test_a_streamed_question_to_a_stream_with_no_frame_is_refused_before_its_events(qa, tmp_path):
    """Before: the reply was a 200 whose one event was the error (409), so a client checking the status saw
    success."""
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={}).json()["id"]
        streamed = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "stream": True})
        assert "no frame yet" in _error(streamed, 409)
        chat = {"messages": [{"role": "user", "content": QUESTION}], "statekv": {"stream_id": stream_id},
                "stream": True}
        assert "no frame yet" in _error(client.post("/v1/chat/completions", json=chat), 409)


def test_a_watch_whose_record_cannot_be_written_is_not_opened(qa, tmp_path, monkeypatch):
    """Before: it answered 201 and the watch ran until the next restart, which did not bring it back."""
    from statekv.serve import store

    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
        real = store.write_atomic

        def full(path, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(store, "write_atomic", full)
        watches = f"/v1/streams/{stream_id}/watches"
        message = _error(client.post(watches, json={"question": QUESTION, "every": 1, "max_new_tokens": 4}), 503)
        assert "No space left on device" in message and "not opened" in message and str(tmp_path) not in message
        assert client.get(watches).json()["data"] == []
        monkeypatch.setattr(store, "write_atomic", real)
        opened = client.post(watches, json={"question": QUESTION, "every": 1, "max_new_tokens": 4})
        assert opened.status_code == 201 and len(client.get(watches).json()["data"]) == 1


def test_a_server_removes_the_uploads_a_stopped_server_left(qa, tmp_path, caplog):
    """Before: a video the page was feeding when the server was killed stayed in uploads/ for good."""
    state = tmp_path / "state"
    (state / "uploads").mkdir(parents=True)
    (state / "uploads" / "0123456789abcdef.mp4").write_bytes(b"\0" * 1000)
    with caplog.at_level("WARNING", logger="statekv.serve"), Running(state, qa):
        assert not any((state / "uploads").iterdir())
    assert "a video the page was feeding when the server stopped" in caplog.text


def test_a_watch_being_opened_takes_one_of_max_asks(qa, tmp_path):
    """Before: watches were opened however many questions were under way (each opening answers its question)."""
    with Running(tmp_path / "state", qa, max_asks=1) as server, server.client() as client:
        stream_id = _stream(client)
        watches = f"/v1/streams/{stream_id}/watches"
        give_back = server.service.ask_slots.take()  # a question under way
        try:
            refused = client.post(watches, json={"question": QUESTION, "every": 1, "max_new_tokens": 4})
            assert "too many questions at once" in _error(refused, 429) and refused.headers.get("Retry-After")
        finally:
            give_back()
        opened = client.post(watches, json={"question": QUESTION, "every": 1, "max_new_tokens": 4})
        assert opened.status_code == 201 and server.service.ask_slots.held == 0


# ---------------------------------------------------------------------------------------------------------------
# Numbers past what a float or a stream holds, text for numbers, and two of one request at once
# ---------------------------------------------------------------------------------------------------------------
HUGE = b"1" + b"0" * 400  # valid JSON: an integer no float holds


def test_numbers_past_a_floats_range_and_sizes_past_any_streams_are_one_line_400s(qa, tmp_path):
    """Before: a stream made with sinks 2**63 or retrieve 10**400 was made (201) and every question to it, before
    and after a restart, was a 500 (its streamed answers cut with no error event); max_fps, a feed's t, a watch's
    every_seconds or a question's retrieve of 10**400 were 500s (OverflowError); a feed's t given as text was
    taken."""
    media = tmp_path / "media"
    make_benchmark(media, videos=1, seed=4245, num_frames=12)
    video = str(next(media.rglob("*.mp4")).relative_to(media))
    json_body = {"Content-Type": "application/json"}
    with Running(tmp_path / "state", qa, media_root=media) as server, server.client() as client:
        for body, setting in ((b'{"method": "rekv", "sinks": 9223372036854775808}', "sinks"),
                              (b'{"retrieve": ' + HUGE + b"}", "retrieve"),
                              (b'{"budget": ' + HUGE[:31] + b"}", "budget"),
                              (b'{"max_fps": ' + HUGE + b"}", "max_fps")):
            message = _error(client.post("/v1/streams", content=body, headers=json_body), 400)
            assert message.startswith(f"{setting} must be"), message
        assert client.get("/v1/streams").json()["data"] == []  # none was made
        stream_id = _stream(client)
        made = client.post("/v1/streams", json={"retrieve": 2**48})  # the largest taken is asked as any other
        assert made.status_code == 201
        for index in range(2):
            _push(client, made.json()["id"], index, float(index)).raise_for_status()
        assert client.post(f"/v1/streams/{made.json()['id']}/ask", json={"question": QUESTION}).status_code == 200
        frames = f"/v1/streams/{stream_id}/frames"
        feed = b'{"source": "' + video.encode() + b'", "t": '
        assert "t must be" in _error(client.post(frames, content=feed + HUGE + b"}", headers=json_body), 400)
        assert "t must be a number" in _error(client.post(frames, json={"source": video, "t": "100"}), 400)
        watch = b'{"question": "Colour?", "every_seconds": ' + HUGE + b"}"
        assert "every_seconds must be" in _error(client.post(f"/v1/streams/{stream_id}/watches", content=watch,
                                                             headers=json_body), 400)
        ask = b'{"question": "Colour?", "retrieve": ' + HUGE + b"}"
        assert "retrieve must be" in _error(client.post(f"/v1/streams/{stream_id}/ask", content=ask,
                                                        headers=json_body), 400)
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 2  # nothing was fed


@pytest.mark.parametrize("route", ["ask", "chat"])
@pytest.mark.parametrize("when", ["before its generation", "during it"])
def test_an_unexpected_error_in_a_streamed_answer_is_its_status_or_an_error_event(qa, tmp_path, monkeypatch, route,
                                                                                 when):
    """Before: only a statekv error became an error event; any other escaped the events once they had begun, and
    the connection was cut mid-answer with no word of why. Met before the answer's generation begins, the error is
    the reply's own status, as a plain answer's."""
    import statekv.serve.registry as registry

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    real_put = TokenStreamer.put

    def put(self, value):
        real_put(self, value)
        if self.tokens:
            broken()

    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = _stream(client)
        if when == "before its generation":
            monkeypatch.setattr(registry, "prompt_tokens", broken)
        else:
            monkeypatch.setattr(TokenStreamer, "put", put)
        if route == "ask":
            reply = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "stream": True})
        else:
            reply = client.post("/v1/chat/completions", json={
                "stream": True, "statekv": {"stream_id": stream_id},
                "messages": [{"role": "user", "content": QUESTION}]})
        failure = {"error": {"message": "internal error (RuntimeError); the server log has the details",
                             "type": "server_error", "code": 500}}
        if when == "before its generation":
            assert reply.status_code == 500 and reply.json() == failure
        else:
            assert reply.status_code == 200 and ("event: error" in reply.text) == (route == "ask")
            assert json.loads([line for line in reply.text.splitlines() if line.startswith("data:")][-1][5:]) == failure
        assert client.get(f"/v1/streams/{stream_id}").status_code == 200  # served on as before


def test_chat_stream_given_as_text_is_a_400(qa, tmp_path):
    """Before: ``"stream": "false"`` was answered as events (any non-empty text counted as true). A stream's own
    ``/ask`` takes ``stream`` as the chat does (before: null was a 400 there, and the message named no value)."""
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = _stream(client)
        reply = client.post("/v1/chat/completions", json={
            "stream": "false", "statekv": {"stream_id": stream_id},
            "messages": [{"role": "user", "content": QUESTION}]})
        assert _error(reply, 400) == 'stream must be true or false, got "false"'
        ask = f"/v1/streams/{stream_id}/ask"
        assert _error(client.post(ask, json={"question": QUESTION, "stream": "false"}), 400) == \
            'stream must be true or false, got "false"'
        for route, body in ((ask, {"question": QUESTION}), ("/v1/chat/completions", {
                "statekv": {"stream_id": stream_id}, "messages": [{"role": "user", "content": QUESTION}]})):
            reply = client.post(route, json={**body, "stream": None, "max_tokens" if "messages" in body else
                                             "max_new_tokens": 2})
            assert reply.status_code == 200 and reply.headers["content-type"] == "application/json", reply.text


def test_feeds_of_one_stream_arriving_together_feed_it_once(qa, tmp_path, monkeypatch):
    """Before: three feeds of one file posted at once all passed the check for a running feed while the file
    opened, and all three were fed: the stream held the file three times."""
    import statekv.video

    opened = statekv.video.open_video

    def slow_open(*args, **kwargs):  # the file opens slowly, so the feeds all arrive while it does
        time.sleep(0.5)
        return opened(*args, **kwargs)

    monkeypatch.setattr(statekv.video, "open_video", slow_open)
    media, video = _one_video(tmp_path, 4246)
    with Running(tmp_path / "state", qa, media_root=media) as server:
        with server.client() as client:
            stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]

        def feed(_):
            with server.client() as client:
                return client.post(f"/v1/streams/{stream_id}/frames", json={"source": video})

        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(feed, range(3)))
        assert sorted(reply.status_code for reply in replies) == [200, 409, 409], [r.text for r in replies]
        fed = next(reply.json() for reply in replies if reply.status_code == 200)
        with server.client() as client:
            assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == fed["kept"] == fed["offered"] > 0


def _frames_through(monkeypatch, each) -> Any:
    """Make every frame a reading of a video file gives pass through ``each(index, frame, video)`` first (to hold
    a feed at a frame, or fail it there); returns the real `statekv.video.open_video`."""
    import statekv.video

    opened = statekv.video.open_video

    def open_video(*args, **kwargs):
        video = opened(*args, **kwargs)
        frames = video.frames

        def through(*args, **kwargs):
            for index, frame in enumerate(frames(*args, **kwargs)):
                each(index, frame, video)
                yield frame

        video.frames = through
        return video

    monkeypatch.setattr(statekv.video, "open_video", open_video)
    return opened


def _one_video(tmp_path: Path, seed: int, frames: int = 12) -> tuple[Path, str]:
    """A media root holding one synthetic video (``frames`` sampled frames), and the video's path under it."""
    media = tmp_path / "media"
    make_benchmark(media, videos=1, seed=seed, num_frames=frames)
    return media, str(next(media.rglob("*.mp4")).relative_to(media))


def _until(done, seconds: float = 60) -> None:
    """Wait (on a decoding thread) until ``done()``, however slow the machine, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_deleting_a_stream_stops_its_feed_under_way_at_once(qa, tmp_path, monkeypatch):
    """The feed stops at its next frame with a 404 saying why (before: "no stream 'st_...'", as if the id were
    wrong), and the DELETE answers without waiting for the rest of the file."""
    import statekv.serve.registry

    decoding = threading.Event()
    _frames_through(monkeypatch, lambda index, frame, video: decoding.set())
    registry = statekv.serve.registry.StreamRegistry
    pushing = registry.push_held

    async def slow_push(self, *args):  # the deletion lands while a push waits, as on a GPU, where pushes take longest
        await asyncio.sleep(0.25)
        return await pushing(self, *args)

    monkeypatch.setattr(registry, "push_held", slow_push)
    media, video = _one_video(tmp_path, 4247, 120)
    with Running(tmp_path / "state", qa, media_root=media) as server:
        with server.client() as client:
            stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]

        def feed():
            with server.client() as client:
                return client.post(f"/v1/streams/{stream_id}/frames", json={"source": video})

        with ThreadPoolExecutor(1) as pool, server.client() as client:
            fed = pool.submit(feed)
            assert decoding.wait(60)
            asked = time.monotonic()
            assert client.delete(f"/v1/streams/{stream_id}").status_code == 200
            deleting = time.monotonic() - asked  # the whole file: two minutes
            reply = fed.result(timeout=120)
            assert client.get(f"/v1/streams/{stream_id}").status_code == 404
    message = _error(reply, 404)
    assert re.fullmatch(f"stream {stream_id} was deleted while feeding {re.escape(video)} \\(\\d+ frames fed\\)",
                        message), message
    assert deleting < 10, deleting


def test_a_feed_under_way_stops_when_asked_saved_and_goes_on_with_its_skip(qa, tmp_path, monkeypatch):
    """Before: a feed of the wrong file (an hour's file) could be stopped only by deleting its stream, or the server.
    ``DELETE /v1/streams/{id}/feed`` stops it after its frame, saved; its request says how to go on, and going on
    with that ``skip`` gives the stream the file's frames once each."""
    import statekv.video

    decoding, feeds = threading.Event(), []

    def held(index, frame, video) -> None:
        if index == 4:  # the feed is asked to stop here
            decoding.set()
            _until(lambda: feeds[0].feed.stopping)

    opened = _frames_through(monkeypatch, held)
    media, video = _one_video(tmp_path, 4248)
    with Running(tmp_path / "state", qa, media_root=media) as server:
        with server.client() as client:
            stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
            feeds.append(server.service.registry.entries[stream_id])
            stop = f"/v1/streams/{stream_id}/feed"
            assert _error(client.delete(stop), 409) == f"stream {stream_id} is not being fed"

        def feed(**fields):
            with server.client() as client:
                return client.post(f"/v1/streams/{stream_id}/frames", json={"source": video, **fields})

        with ThreadPoolExecutor(1) as pool, server.client() as client:
            fed = pool.submit(feed)
            assert decoding.wait(60)
            stopped = client.delete(stop)
            reply = fed.result(timeout=120)
            about = client.get(f"/v1/streams/{stream_id}").json()
        frames = opened(str(media / video)).num_frames
        assert stopped.status_code == 200, stopped.text
        skip = stopped.json()["skip"]
        assert stopped.json()["stopped"] and not stopped.json()["running"] and 3 <= skip < frames, stopped.text
        assert about["frames"] == skip and about["state"] == "ready" and about["saved"]["pushed"] == skip, about
        assert _error(reply, 409) == (f'feeding {video} was stopped as asked after {skip} of its {frames} frames, '
                                      f'saved; '
                                      f'send {{"source": "{video}", "skip": {skip}}} to go on ({skip} frames fed)')
        monkeypatch.setattr(statekv.video, "open_video", opened)
        rest = feed(skip=skip)
        assert rest.status_code == 200 and rest.json()["offered"] == frames - skip, rest.text
        assert rest.json()["frames"] == frames and rest.json()["state"] == "ready", rest.text
        with server.client() as client:
            assert _error(client.delete(stop), 409) == f"stream {stream_id} is not being fed"


def test_a_feed_that_fails_or_is_stopped_while_skipping_says_what_the_stream_holds(qa, tmp_path, monkeypatch):
    """The feed hunt's cases. Before: a feed whose file failed part-way saved nothing of what it had pushed; a stop
    that met such a failure answered 200 "stopped" and the stream read ready; a stop while the feed skipped
    frames named the skip asked for, not the frames passed, and going on with it would have left some out."""
    from statekv.errors import FrameDecodeError

    plan, feeds = {}, []

    def planned(index, frame, video) -> None:
        if index == plan["at"]:
            if plan.get("wait"):  # until the stop is asked
                _until(lambda: feeds[-1].feed.stopping)
            if plan.get("fail"):
                raise FrameDecodeError(f"{video.name}: frame {index} cannot be decoded", index=index,
                                       timestamp=frame.timestamp)

    _frames_through(monkeypatch, planned)
    media, video = _one_video(tmp_path, 4249)
    with Running(tmp_path / "state", qa, media_root=media) as server, server.client() as client:
        def fed(body: dict) -> tuple[str, httpx.Response, httpx.Response | None]:
            stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
            feeds.append(server.service.registry.entries[stream_id])
            with ThreadPoolExecutor(1) as pool, server.client() as feeder:
                feeding = pool.submit(feeder.post, f"/v1/streams/{stream_id}/frames", json=body)
                stopped = None
                if plan.get("wait"):  # the frames before the planned one gone through: the feed waits for it
                    while not feeding.done() and (feeds[-1].feed is None or
                                                  feeds[-1].feed.offered + feeds[-1].feed.skipped < plan["at"]):
                        time.sleep(0.01)
                    stopped = client.delete(f"/v1/streams/{stream_id}/feed")
                return stream_id, feeding.result(timeout=120), stopped

        plan.update(at=10, fail=True)
        stream_id, reply, _ = fed({"source": video})
        assert "frame 10 cannot be decoded" in _error(reply, 400) and "(10 frames fed)" in reply.json()["error"][
            "message"]
        about = client.get(f"/v1/streams/{stream_id}").json()
        assert about["state"] == "failed" and about["saved"]["pushed"] == 10, about  # before: 0

        plan.update(at=5, fail=True, wait=True)
        stream_id, reply, stopped = fed({"source": video})
        assert "ended before it could be stopped: " in _error(stopped, 409) and "cannot be decoded" in \
            stopped.json()["error"]["message"]
        _error(reply, 400)
        assert client.get(f"/v1/streams/{stream_id}").json()["state"] == "failed"

        plan.update(at=10, fail=False, wait=True)
        stream_id, reply, stopped = fed({"source": video, "skip": 30})
        assert stopped.status_code == 200 and stopped.json()["skip"] == 10, stopped.text  # before: 30
        assert "after 10 of its 48 frames" in _error(reply, 409)
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 0


def test_a_feed_is_shown_and_can_be_stopped_while_its_file_opens(qa, tmp_path, monkeypatch):
    """A long Matroska file is read through once as it opens (its frames counted). Before: meanwhile the stream read
    empty, a stop answered that it was not being fed, and the feed then ran anyway."""
    import statekv.video

    opened, feeds = statekv.video.open_video, []

    def slow_open(*args, **kwargs):
        _until(lambda: feeds and feeds[0].feed is not None and feeds[0].feed.stopping)
        return opened(*args, **kwargs)

    monkeypatch.setattr(statekv.video, "open_video", slow_open)
    media, video = _one_video(tmp_path, 4250)
    with Running(tmp_path / "state", qa, media_root=media) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
        feeds.append(server.service.registry.entries[stream_id])
        with ThreadPoolExecutor(1) as pool, server.client() as feeder:
            feeding = pool.submit(feeder.post, f"/v1/streams/{stream_id}/frames", json={"source": video})
            deadline = time.monotonic() + 30
            while client.get(f"/v1/streams/{stream_id}").json()["state"] != "feeding":
                assert time.monotonic() < deadline and not feeding.done(), "the feed was not shown while it opened"
                time.sleep(0.05)
            stopped = client.delete(f"/v1/streams/{stream_id}/feed")
            reply = feeding.result(timeout=120)
        assert stopped.status_code == 200 and stopped.json()["skip"] == 0, stopped.text
        assert "was stopped as asked after 0 of its 48 frames" in _error(reply, 409)
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 0


def test_a_feed_arriving_behind_pushes_still_queued_places_its_frames_after_theirs(qa, tmp_path):
    """Before: a feed read where the stream's frames ended as soon as it held the stream, while pushes answered 200
    before it still waited for the model: it was refused (timestamps going back) or its first frame was lost."""
    media, video = _one_video(tmp_path, 4251)
    with Running(tmp_path / "state", qa, media_root=media) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        busy = threading.Thread(target=server.service.worker.run_blocking, args=(time.sleep, 3.0))
        busy.start()  # the model's thread is busy: the pushes below wait for it, queued
        time.sleep(0.1)
        with ThreadPoolExecutor(3) as pool:
            pushes = [pool.submit(client.post, f"/v1/streams/{stream_id}/frames", content=_png(index),
                                  headers={"Content-Type": "image/png"}) for index in range(3)]
            time.sleep(0.5)  # (queued at once: the model is busy for seconds more)
            fed = client.post(f"/v1/streams/{stream_id}/frames", json={"source": video})
            assert all(push.result(timeout=60).status_code == 200 for push in pushes)
        busy.join()
        assert fed.status_code == 200 and fed.json()["kept"] == fed.json()["offered"] > 0, fed.text
        about = client.get(f"/v1/streams/{stream_id}").json()
        assert about["frames"] == about["pushed"] == 3 + fed.json()["offered"], about


def test_deletes_of_one_watch_arriving_together_delete_it_once(qa, tmp_path):
    """Before: four deletes of one watch at once were each answered 200 (each found it before any closed it)."""
    with Running(tmp_path / "state", qa) as server:
        with server.client() as client:
            stream_id = _stream(client)
            made = client.post(f"/v1/streams/{stream_id}/watches", json={"question": QUESTION, "every": 1,
                                                                        "max_new_tokens": 2})
            watch = f"/v1/streams/{stream_id}/watches/{made.json()['id']}"

        def delete(_):
            with server.client() as client:
                return client.delete(watch).status_code

        with ThreadPoolExecutor(4) as pool:
            statuses = sorted(pool.map(delete, range(4)))
        assert statuses == [200, 404, 404, 404]


def test_a_simplestream_stream_goes_on_from_its_counts_after_a_restart(qa, tmp_path):
    """A simplestream stream's frames are not kept, its counts are. Before: after a restart it counted from 0 again
    (frames pushed without a time were placed before its watch's events) and its watch stayed silent until the
    stream passed the frame of its last evaluation."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"method": "simplestream"}).json()["id"]
        watch = client.post(f"/v1/streams/{stream_id}/watches", json={"question": QUESTION, "every": 2,
                                                                      "max_new_tokens": 2}).json()["id"]
        for index in range(6):
            client.post(f"/v1/streams/{stream_id}/frames", content=_png(index),
                        headers={"Content-Type": "image/png"}).raise_for_status()
        before = client.get(f"/v1/streams/{stream_id}/watches/{watch}").json()
    with Running(state, qa) as server, server.client() as client:
        described = client.get(f"/v1/streams/{stream_id}").json()
        assert (described["frames"], described["pushed"], described["seconds"]) == (6, 6, 5.0)
        asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION})
        assert "no frame has been pushed since it went on from its counts" in _error(asked, 400)
        made = client.post(f"/v1/streams/{stream_id}/watches", json={"question": QUESTION, "every": 4,
                                                                     "max_new_tokens": 2})
        assert made.status_code == 201  # evaluated once it holds frames
        assert client.get(f"/v1/streams/{stream_id}/watches/{made.json()['id']}").json()["evaluations"] == 0
        for index in range(6, 10):
            client.post(f"/v1/streams/{stream_id}/frames", content=_png(index),
                        headers={"Content-Type": "image/png"}).raise_for_status()
        described = client.get(f"/v1/streams/{stream_id}").json()
        after = client.get(f"/v1/streams/{stream_id}/watches/{watch}").json()
    assert (described["frames"], described["seconds"]) == (10, 9.0)
    assert after["evaluations"] == before["evaluations"] + 2  # at frames 8 and 10
    assert made.json()["id"] != watch


def test_an_answer_that_read_every_frame_of_a_long_stream_keeps_its_record_small(qa, tmp_path):
    """Each answer's note in the record listed every frame it read: an answer reading the whole cache of a long
    stream made the record grow with the stream's age (rewritten at every answer). The HTTP answer still lists
    them, and a record an earlier version wrote, its notes listing the frames, still loads and reads them."""
    from types import SimpleNamespace

    from statekv.serve.page_parts import read_text
    from statekv.serve.page_watches import TIMELINE_POINTS, timeline_rows

    def push(start: int, stop: int) -> None:
        for index in range(start, stop):
            _push(client, stream_id, index, float(index)).raise_for_status()

    def ask_all() -> dict:
        asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 2,
                                                                  "retrieve": 100_000})
        assert asked.status_code == 200, asked.text
        return asked.json()

    state = tmp_path / "state"
    path = state / "streams"
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(0, 10)
        assert ask_all()["read_frames"] == list(range(10))
        push(10, 120)
        assert ask_all()["read_frames"] == list(range(120))
        short, long = (json.dumps(note) for note in json.loads((path / f"{stream_id}.json").read_text())["answers"])
        assert len(long) - len(short) < 40, (short, long)
    record = json.loads((path / f"{stream_id}.json").read_text())  # as the previous version wrote it:
    for note, read in zip(record["answers"], (10, 120)):  # the frames themselves, under read_frames
        note.pop("read_ranges", None)
        note["read_frames"] = list(range(read))
    record["answers"].append({**record["answers"][-1], "read_frames": None})
    (path / f"{stream_id}.json").write_text(json.dumps(record, indent=1))
    with Running(state, qa) as server, server.client() as client:
        ask_all()
        notes = json.loads((path / f"{stream_id}.json").read_text())["answers"]
        assert len(notes) == 4 and max(len(json.dumps(note)) for note in notes) < 400, notes
        assert [read_text(note) for note in notes[:3]] == [
            "read 10 frames: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9", "read 120 frames: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 …",
            "read every frame held (120)"]
        _, read, _ = timeline_rows(SimpleNamespace(answers=notes, stream=SimpleNamespace(watches=[])))
        assert 120 < TIMELINE_POINTS and [point[0] for point in read] == [*range(10), *list(range(120)) * 3]
