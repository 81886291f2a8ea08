"""`statekv serve` with real parts: the server as a process on a loopback port, the built-in model, the official
`openai` client, concurrent clients, kill -9 and restart, keys across restarts, and a real browser on the page
(Debian's Chromium through Playwright), driven as a new user would.

Every answer the server gives is compared with the same stream run alone through the Python API (the server's
default for the built-in model is StateKV with a budget of 64 tokens, so the streams alone use the same).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")
from PIL import Image  # noqa: E402

import statekv  # noqa: E402
from statekv.testing.videos import write_test_video  # noqa: E402
from statekv.video import open_video  # noqa: E402

import bad_videos  # noqa: E402
from conftest import random_frames  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
KEY, OTHER_KEY = "test-key-one", "test-key-two"
QUESTION = "What colour was the triangle?\nA. red\nB. green\nC. blue\nD. yellow\nAnswer with the letter."
NEW_TOKENS = 6
BATCHED_BUDGET = 4  # tokens: one frame of the built-in model
OPEN_QUESTION = "What colour was the triangle?"  # answered at length (the letter question ends after one token)
START_SECONDS = 180
SIZE = (48, 64)  # the frames a client sends: height, width
SERVER_BUDGET = 64  # `statekv serve`'s default for the built-in model
CHROMIUM = shutil.which("chromium")


# -- the server process ----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    def __init__(self, state: Path, media: Path, *extra: str, keys: tuple[str, ...] = (KEY, OTHER_KEY),
                 launch: tuple[str, ...] = ("-m", "statekv.cli")):
        """``launch``: what runs the command line (``python -c SCRIPT`` to change the server first, say)."""
        self.state, self.media, self.extra, self.keys, self.launch = state, media, extra, keys, launch
        self.process: subprocess.Popen | None = None
        self.url, self.port = "", None

    def start(self) -> "Server":
        """Start (a restart comes back on the same port, as a person's bookmarks expect)."""
        port = self.port = self.port or _free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("STATEKV_API_KEYS", None)
        self.log = open(self.state.parent / f"server-{port}.log", "w")
        keys = [argument for key in self.keys for argument in ("--api-key", key)]
        self.process = subprocess.Popen(
            [sys.executable, *self.launch, "serve", "--host", "127.0.0.1", "--port", str(port),
             "--state-dir", str(self.state), "--media-root", str(self.media), *keys, *self.extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            assert self.process.poll() is None, Path(self.log.name).read_text()[-2000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"the server did not start in {START_SECONDS} s: {self.printed()[-2000:]}")

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.log.close()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def printed(self) -> str:
        return Path(self.log.name).read_text()

    def client(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    from statekv.cli import main

    for folder, videos, seed, frames in (("held-out", 1, 4242, 12), ("pair", 2, 4243, 40), ("long", 1, 4244, 120)):
        assert main(["synthetic", "make", "--out", str(root / folder), "--videos", str(videos), "--seed", str(seed),
                     "--frames", str(frames)]) == 0
    (root / "not-a-video.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 200)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, media):
    state = tmp_path_factory.mktemp("server") / "state"
    running = Server(state, media, "--max-streams", "24", "--max-asks", "16", "--max-body-mb", "1",
                     "--save-every-frames", "2", "--save-every-seconds", "600").start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_pretrained("builtin", budget=SERVER_BUDGET)


def _video(media: Path) -> Path:
    return media / "held-out" / "videos" / "v0000.mp4"


def _png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def _alone(qa, frames: list[np.ndarray], question: str = QUESTION, horizon: int = 16) -> str:
    """The answer of the same stream run alone through the Python API."""
    with qa.stream(horizon_frames=horizon, max_fps=None) as stream:
        for index, image in enumerate(frames):
            stream.push(image, float(index))
        return stream.ask(question, max_new_tokens=NEW_TOKENS)


def _error(response, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    message = response.json()["error"]["message"]
    assert message and "\n" not in message and "Traceback" not in message
    return message


def _create(client, **settings) -> str:
    response = client.post("/v1/streams", json={"horizon_frames": 16, "max_fps": None, **settings})
    assert response.status_code == 201, response.text
    return response.json()["id"]


# -- the checks ----------------------------------------------------------------------------------------------------
def test_a_held_out_video_under_the_media_root_answers_as_videoqa(server, qa, media):
    with server.client() as client:
        stream_id = _create(client, max_fps=1.0, horizon_frames=64)
        fed = client.post(f"/v1/streams/{stream_id}/frames", json={"source": "held-out/videos/v0000.mp4"})
        assert fed.status_code == 200, fed.text
        assert fed.json()["kept"] == 12 and fed.json()["frames"] == 12
        answer = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": NEW_TOKENS})
        assert answer.status_code == 200, answer.text
        stats = client.get(f"/v1/streams/{stream_id}").json()
        endless = client.get(f"/v1/streams/{_create(client, horizon_frames=None)}").json()
    with qa.stream(max_fps=None) as endless_alone:
        assert endless["handover"] == endless_alone.handover is not None  # bounded: its engines are reported
    with qa.stream(horizon_frames=64, max_fps=1.0) as alone:
        for frame in open_video(_video(media)).sample_at_rate(1.0):
            alone.push(frame)
        expected = alone.ask(QUESTION, max_new_tokens=NEW_TOKENS)
        generated = alone.ask_tokens(QUESTION, max_new_tokens=NEW_TOKENS).shape[1]
        read = alone.tokens + qa.adapter.question_ids(QUESTION, alone.state).shape[1]
        handover = alone.handover
    reply = answer.json()
    assert {key: reply[key] for key in ("answer", "frames", "seconds", "id")} == {
        "answer": expected, "frames": 12, "seconds": 11.0, "id": stream_id}
    assert reply["usage"] == {"prompt_tokens": read, "completion_tokens": generated, "total_tokens": read + generated}
    assert generated >= 1 and 0 < reply["latency"] < 60
    assert expected == qa.answer(_video(media), QUESTION, max_new_tokens=NEW_TOKENS)  # VideoQA.encode's answer
    assert stats["frames"] == 12 and stats["tokens"] > 12 and stats["carried"] > 0 and stats["cache_bytes"] > 0
    assert stats["handover"] == handover  # what the same stream made alone says of its engines
    assert stats["saved"]["frames"] == 12 and stats["resume_from"] == 12  # a source fed in full is saved


def test_a_stream_made_without_a_horizon_runs_past_the_models_range(tmp_path, media):
    """No horizon by default: a stream outlives the model's positional range (a tiny model of 256 positions, fed
    three times as many) and still answers; nothing answers 409 for its age."""
    from statekv.testing import make_tiny_checkpoint

    short = {"max_position_embeddings": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "short", text_config=short,
                                      vision_config={"image_size": 112})
    (tmp_path / "state").mkdir()
    running = Server(tmp_path / "state", media, "--model", str(checkpoint), "--save-every-frames", "1000").start()
    try:
        with running.client() as client:
            reply = client.post("/v1/streams", json={"max_fps": None})
            assert reply.status_code == 201, reply.text
            stream_id = reply.json()["id"]
            for image in random_frames(50, 7, *SIZE):
                pushed = client.post(f"/v1/streams/{stream_id}/frames", content=_png(image),
                                     headers={"Content-Type": "image/png"})
                assert pushed.status_code == 200, pushed.text
            stats = client.get(f"/v1/streams/{stream_id}").json()
            assert stats["horizon_frames"] is None and stats["tokens"] > 3 * 256
            answer = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 4})
            assert answer.status_code == 200, answer.text
    finally:
        running.stop()


def test_answers_stream_token_by_token(server):
    with server.client() as client:
        stream_id = _create(client)
        for index, image in enumerate(random_frames(2, 7, *SIZE)):
            client.post(f"/v1/streams/{stream_id}/frames?t={index}", content=_png(image),
                        headers={"Content-Type": "image/png"}).raise_for_status()
        before = _first_token_totals(client)
        whole = client.post(f"/v1/streams/{stream_id}/ask", json={"question": OPEN_QUESTION, "max_new_tokens": NEW_TOKENS})
        with client.stream("POST", f"/v1/streams/{stream_id}/ask",
                           json={"question": OPEN_QUESTION, "max_new_tokens": NEW_TOKENS, "stream": True}) as events:
            assert events.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in events.iter_lines() if line.startswith("data: ")]
        after = _first_token_totals(client)
    pieces = [json.loads(line[6:]) for line in lines]
    tokens = [piece["token"] for piece in pieces[:-1]]
    final, expected = pieces[-1], whole.json()
    latency = final.pop("latency")
    assert len(tokens) >= 2 and latency > 0 and expected.pop("latency") > 0 and final == expected
    assert "".join(tokens).strip() == whole.json()["answer"]
    # the server's time to the first token: the streamed answer observed, within its time; the whole one not
    assert after[1] == before[1] + 1 and 0 < after[0] - before[0] <= latency


def _first_token_totals(client) -> tuple[float, float]:
    """``(sum, count)`` of the server's statekv_time_to_first_token_seconds."""
    text = client.get("/metrics").text
    return tuple(float(re.search(rf"^statekv_time_to_first_token_seconds_{name} (\S+)$", text, re.MULTILINE).group(1))
                 for name in ("sum", "count"))


def test_keys_are_required_and_see_only_their_own_streams(server):
    with server.client() as client, server.client(OTHER_KEY) as other, server.client(None) as anonymous:
        stream_id = _create(client)
        _error(anonymous.get("/v1/streams"), 401)
        _error(anonymous.get("/v1/models"), 401)
        _error(anonymous.post("/v1/streams", json={}), 401)
        with server.client("not-a-key") as stranger:
            _error(stranger.get(f"/v1/streams/{stream_id}"), 401)
        for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/ask")):
            _error(other.request(method, f"/v1/streams/{stream_id}{path}", json={"question": "q"}), 404)
        assert stream_id not in [s["id"] for s in other.get("/v1/streams").json()["data"]]
        assert stream_id in [s["id"] for s in client.get("/v1/streams").json()["data"]]
        _error(client.get("/v1/streams/st_000000000000000000000000"), 404)
        _error(client.get("/v1/streams/../../etc"), 404)
        assert client.delete(f"/v1/streams/{stream_id}").json()["deleted"] is True
        _error(client.get(f"/v1/streams/{stream_id}"), 404)


def test_sources_stay_inside_the_media_root(server, media, tmp_path):
    outside = tmp_path / "secret.mp4"
    shutil.copy(_video(media), outside)
    link = media / "link-out.mp4"
    link.symlink_to(outside)
    (media / "dir-link").symlink_to(tmp_path, target_is_directory=True)
    with server.client() as client:
        stream_id = _create(client)
        frames = f"/v1/streams/{stream_id}/frames"
        for source in ("../secret.mp4", "held-out/../../secret.mp4", str(outside), "link-out.mp4",
                       "dir-link/secret.mp4"):
            assert "media root" in _error(client.post(frames, json={"source": source}), 403)
        _error(client.post(frames, json={"source": "held-out/videos/missing.mp4"}), 404)
        assert "is a folder" in _error(client.post(frames, json={"source": "held-out/videos"}), 400)
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 0
        chat = {"model": "builtin", "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": outside.as_uri()}}, {"type": "text", "text": QUESTION}]}]}
        _error(client.post("/v1/chat/completions", json=chat), 403)
        chat["messages"][0]["content"][0]["video_url"]["url"] = "http://example.com/v.mp4"
        _error(client.post("/v1/chat/completions", json=chat), 400)


def test_a_feed_takes_a_file_url_and_a_chat_over_a_file_cut_short_says_what_to_do_over_http(server, media, tmp_path):
    """A feed's ``source`` given as a ``file://`` URL (as a chat's ``video_url`` is) was looked for as a path under
    the media root whose first folder is ``file:`` (a 404); a chat over a file that stops partway answered with a
    hint to read the error's ``.encoded``, an attribute only a Python caller has; a chat's later turn, asking about
    the video its first turn gave, was refused for want of one."""
    shutil.copy(bad_videos.cut_after_header(tmp_path, frames=40, fps=4, keep=0.6), media / "cut-partway.mp4")
    with server.client() as client:
        stream_id = _create(client, max_fps=1.0, horizon_frames=64)
        frames = f"/v1/streams/{stream_id}/frames"
        fed = client.post(frames, json={"source": _video(media).as_uri()})
        assert fed.status_code == 200 and fed.json()["kept"] == 12, fed.text
        assert "outside the media root" in _error(client.post(frames, json={"source": (tmp_path / "v.mp4").as_uri()}),
                                                  403)
        assert "is not a local file" in _error(client.post(frames, json={"source": "file://host/v.mp4"}), 400)
        assert "is not a URL" in _error(client.post(frames, json={"source": "file://[::1/v.mp4"}), 400)
        single = client.post(frames, json={"source": "file:" + str(_video(media)), "t": 100})  # one slash: a URL too
        assert single.status_code == 200 and single.json()["kept"] == 12, single.text
        client.delete(f"/v1/streams/{stream_id}").raise_for_status()
        chat = {"model": "builtin", "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": (media / "cut-partway.mp4").as_uri()}},
            {"type": "text", "text": QUESTION}]}]}
        message = _error(client.post("/v1/chat/completions", json=chat), 400)
        assert "cut-partway.mp4" in message and "cannot be decoded" in message, message
        assert ".encoded" not in message and "feed it to a stream" in message, message
        video = {"type": "video_url", "video_url": {"url": _video(media).as_uri()}}
        turns = [{"role": "user", "content": [video, {"type": "image_url", "image_url": {"url": "x"}}]},
                 {"role": "assistant", "content": "Noted."}, {"role": "user", "content": QUESTION}]
        later = client.post("/v1/chat/completions", json={"messages": turns, "max_tokens": NEW_TOKENS})
        first = client.post("/v1/chat/completions", json={"max_tokens": NEW_TOKENS, "messages": [
            {"role": "user", "content": [video, {"type": "text", "text": QUESTION}]}]})
        assert later.status_code == 200, later.text  # before: a 400 asking for the video_url part it had
        assert later.json()["statekv"]["read"] == "the video of an earlier user message and the last user message"
        assert later.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]


def test_the_openai_client_works_unchanged(server, qa, media):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    assert [model.id for model in client.models.list()] == ["builtin"]
    video = {"type": "video_url", "video_url": {"url": _video(media).as_uri()}}
    messages = [{"role": "user", "content": [video, {"type": "text", "text": QUESTION}]}]
    reply = client.chat.completions.create(model="builtin", messages=messages, max_tokens=NEW_TOKENS)
    expected = qa.answer(_video(media), QUESTION, max_new_tokens=NEW_TOKENS)
    assert reply.choices[0].message.content == expected
    with qa.encode(_video(media)) as encoded:  # usage: the tokens the answer read and generated
        generated = encoded.ask_tokens(QUESTION, max_new_tokens=NEW_TOKENS).shape[1]
        read = encoded.tokens + qa.adapter.question_ids(QUESTION, encoded.state).shape[1]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (read, generated) and generated >= 1
    assert reply.choices[0].finish_reason == ("length" if generated == NEW_TOKENS else "stop")
    chunks = client.chat.completions.create(model="builtin", messages=messages, max_tokens=NEW_TOKENS, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks).strip() == expected

    with server.client() as http:
        stream_id = _create(http)
        frames = random_frames(2, 11, *SIZE)
        for index, image in enumerate(frames):
            http.post(f"/v1/streams/{stream_id}/frames?t={index}", content=_png(image),
                      headers={"Content-Type": "image/png"}).raise_for_status()
    live = client.chat.completions.create(model="builtin", max_tokens=NEW_TOKENS,
                                          messages=[{"role": "user", "content": QUESTION}],
                                          extra_body={"statekv": {"stream_id": stream_id}})
    assert live.choices[0].message.content == _alone(qa, frames)
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY).chat.completions.create(
            model="builtin", messages=[{"role": "user", "content": QUESTION}],
            extra_body={"statekv": {"stream_id": stream_id}})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong").models.list()


def test_bad_requests_get_one_line_json_errors(server):
    with server.client() as client:
        stream_id = _create(client)
        frames, ask = f"/v1/streams/{stream_id}/frames", f"/v1/streams/{stream_id}/ask"
        json_type = {"Content-Type": "application/json"}
        _error(client.post("/v1/streams", content=b"{not json", headers=json_type), 400)
        _error(client.post("/v1/streams", content=b"[1, 2]", headers=json_type), 400)
        _error(client.post("/v1/streams", content=b"{}", headers={"Content-Type": "text/plain"}), 415)
        _error(client.post("/v1/streams", json={"budget": -3}), 400)
        _error(client.post("/v1/streams", json={"horizon_frames": "many"}), 400)
        _error(client.post("/v1/streams", json={"colour": "red"}), 400)
        beyond = client.post("/v1/streams", json={"horizon_frames": 2000})  # beyond the RoPE: bounded positions
        assert beyond.status_code == 201, beyond.text
        client.delete(f"/v1/streams/{beyond.json()['id']}").raise_for_status()
        _error(client.post(frames, content=b"hello", headers={"Content-Type": "text/plain"}), 415)
        broken = _error(client.post(frames, content=b"\x89PNG\r\n\x1a\nbroken", headers={"Content-Type": "image/png"}), 400)
        assert "0x" not in broken and "<" not in broken  # no repr of PIL's in-memory file
        jpeg = io.BytesIO()
        Image.fromarray(random_frames(1, 1, *SIZE)[0]).save(jpeg, format="JPEG")
        _error(client.post(frames, content=jpeg.getvalue(), headers={"Content-Type": "image/png"}), 415)
        assert "is not JPEG" in _error(client.post(frames, content=b"notajpeg", headers={"Content-Type": "image/jpeg"}),
                                       415)
        _error(client.post(f"{frames}?t=-1", content=jpeg.getvalue(), headers={"Content-Type": "image/jpeg"}), 400)
        assert "past the latest time a stream takes" in _error(client.post(
            f"{frames}?t=1e308", content=jpeg.getvalue(), headers={"Content-Type": "image/jpeg"}), 400)
        _error(client.post(frames, content=b"x" * (1_200_000), headers={"Content-Type": "image/png"}), 413)
        huge = io.BytesIO()
        Image.new("L", (5000, 5000)).save(huge, format="PNG")  # small file, 25 million pixels decoded
        _error(client.post(frames, content=huge.getvalue(), headers={"Content-Type": "image/png"}), 413)
        assert "no frame yet" in _error(client.post(ask, json={"question": QUESTION}), 409)
        _error(client.post(ask, json={"question": ""}), 400)
        _error(client.post(ask, json={"question": QUESTION, "max_new_tokens": 0}), 400)
        _error(client.post(ask, json={"question": QUESTION, "temperature": 2}), 400)
        _error(client.post("/v1/chat/completions", json={"messages": "hi"}), 400)
        for part, message in (({"type": "video_url", "video_url": "file:///v.mp4"}, "a video_url part's video_url "
                                "must be an object"), ({"type": "text", "text": 5}, "a text part's text must be a "
                                "string"), ({"type": "image_url"}, 'unsupported content part "image_url"')):
            asked = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]}
            assert _error(client.post("/v1/chat/completions", json=asked), 400).startswith(message)
        misspelt = {"messages": [{"role": "user", "content": QUESTION}], "statekv": {"stream": stream_id}}
        assert _error(client.post("/v1/chat/completions", json=misspelt), 400) == (
            'unknown statekv field "stream"; known: stream_id, retrieve')
        _error(client.get("/v1/nothing-here"), 404)
        _error(client.put("/v1/streams"), 405)
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 0


def test_limits_and_failures_are_named_without_server_paths_or_reprs(server, media):
    with server.client() as client:
        past = client.post("/v1/streams", json={"horizon_frames": 600})  # past the RoPE's 519: bounded positions
        assert past.status_code == 201 and past.json()["horizon_frames"] == 600, past.text
        client.delete(f"/v1/streams/{past.json()['id']}").raise_for_status()
        message = _error(client.post("/v1/streams", json={"horizon_frames": 0}), 400)
        assert "an integer from 1 to 10000000 or null (no horizon), got 0" in message
        for rate in (1e20, 1e308):  # a file fed at such a rate would have no tick for its frames
            assert "max_fps must be a number above 0 and at most 4e+07, or null" in _error(
                client.post("/v1/streams", json={"max_fps": rate}), 400)
        for field, value, message in (("budget", True, "budget must be a positive integer, got true"),
                                      ("sinks", None, "sinks must be a non-negative integer, got null"),
                                      ("retrieve", "4", 'retrieve must be a positive integer, got "4"'),
                                      ("method", False, "method must be a method's name (text), got false")):
            assert _error(client.post("/v1/streams", json={"method": "rekv", field: value}), 400) == message
        empty = client.post("/v1/streams")  # no body at all: every field is optional
        assert empty.status_code == 201 and empty.json()["state"] == "empty", empty.text
        assert empty.json()["horizon_frames"] is None and empty.json()["settings"]["budget"] == SERVER_BUDGET
        client.delete(f"/v1/streams/{empty.json()['id']}").raise_for_status()
        for method in ("statekv", "full", "recency", "rekv", "simplestream"):  # settings read back make it again
            made = client.post("/v1/streams", json={"method": method})
            assert made.status_code == 201, made.text
            again = client.post("/v1/streams", json=made.json()["settings"])  # before: 400, sinks not used
            assert again.status_code == 201 and again.json()["settings"] == made.json()["settings"], again.text
            for stream in (made, again):
                client.delete(f"/v1/streams/{stream.json()['id']}").raise_for_status()
        stream_id = _create(client, horizon_frames=4)  # room for about 1000 tokens of question and answer
        frames, ask = f"/v1/streams/{stream_id}/frames", f"/v1/streams/{stream_id}/ask"
        bad = _error(client.post(frames, json={"source": "not-a-video.mp4"}), 400)
        assert "not-a-video.mp4" in bad and str(media) not in bad and os.path.realpath(media) not in bad
        stats = client.get(f"/v1/streams/{stream_id}").json()
        assert stats["frames"] == 0 and stats["state"] == "empty"
        held_out = "held-out/videos/v0000.mp4"  # 48 frames at its own 4 fps (the stream keeps every frame)
        nothing_left = client.post(frames, json={"source": held_out, "skip": 48})  # a feed stopped at its end goes on
        assert nothing_left.status_code == 200 and nothing_left.json()["offered"] == 0, nothing_left.text
        assert _error(client.post(frames, json={"source": held_out, "skip": 49}), 400).startswith(
            "skip 49 is past the end of held-out/videos/v0000.mp4: it gives 48 frames at the stream's rate (0 frames")
        assert _error(client.post(frames, json={"source": held_out, "skip": 10**20}), 400) == (
            "skip must be a whole number of frames from 0 to 281,474,976,710,656; got 100000000000000000000")
        client.post(frames, content=_png(random_frames(1, 5, *SIZE)[0]),
                    headers={"Content-Type": "image/png"}).raise_for_status()
        assert "over the limit of 8000" in _error(client.post(ask, json={"question": "x" * 20_000}), 413)
        wordy = " ".join(["red"] * 1300)  # under 8000 characters, over the room kept for question and answer
        message = _error(client.post(ask, json={"question": wordy}), 413)
        assert re.search(r"the question is \d+ tokens and its answer up to 64: more than the \d+ tokens", message)
        assert "reserve_tokens" not in message
        client.delete(f"/v1/streams/{stream_id}").raise_for_status()


def test_a_feed_keeps_every_frame_of_a_variable_rate_file_and_a_skip_on_an_empty_stream_keeps_the_files_times(
        server, media):
    """Before: a stream keeping every frame (max_fps null) was fed at the file's average rate, so a variable-rate
    file lost frames where they were dense; and a feed skipping frames on a stream holding none placed the rest
    as many seconds early as it skipped."""
    import av
    from fractions import Fraction

    times = [k / 4 for k in range(24)] + [6.0 + k for k in range(6)]  # 4 fps, then 1 fps
    with av.open(str(media / "recording.mp4"), "w") as container:
        stream = container.add_stream("libx264", rate=None, options={"bf": "0"})
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        stream.time_base = Fraction(1, 1000)
        for index, time in enumerate(times):
            frame = av.VideoFrame.from_ndarray(random_frames(1, index, 32, 64)[0], format="rgb24")
            frame.pts, frame.time_base = round(time * 1000), Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    with server.client() as client:
        every = _create(client, horizon_frames=64)
        fed = client.post(f"/v1/streams/{every}/frames", json={"source": "recording.mp4"}).json()
        assert fed["kept"] == 30, fed
        seconds = [point["seconds"] for point in client.get(f"/v1/streams/{every}/history").json()["history"]]
        assert seconds == pytest.approx(times, abs=1e-3)
        skipped = _create(client, max_fps=1)
        fed = client.post(f"/v1/streams/{skipped}/frames", json={"source": "held-out/videos/v0000.mp4", "skip": 5})
        assert fed.status_code == 200 and fed.json()["kept"] == 7, fed.text  # seconds 5 to 11 of 12
        seconds = [point["seconds"] for point in client.get(f"/v1/streams/{skipped}/history").json()["history"]]
        assert seconds == [5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]  # where a feed from the start puts them
        refused = client.post(f"/v1/streams/{skipped}/frames", json={"source": "held-out/videos/v0000.mp4",
                                                                     "skip": 500})
        assert refused.status_code == 400 and "past the end" in refused.text, refused.text
        state = client.get(f"/v1/streams/{skipped}").json()  # before: "failed", its frames untouched
        assert state["state"] == "ready" and state["frames"] == 7 and state["feed"]["error"] is None, state
        for stream_id in (every, skipped):
            client.delete(f"/v1/streams/{stream_id}").raise_for_status()


def _errors_counted(client, status: int, route: str) -> float:
    lines = client.get("/metrics").text.splitlines()
    wanted = (f'statekv_errors_total{{route="{route}",status="{status}"}}',
              f'statekv_errors_total{{status="{status}",route="{route}"}}')
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(wanted))


def test_a_streamed_answer_whose_client_leaves_is_counted_as_a_499(server):
    """Before: only an answer not streamed was counted in ``statekv_errors_total`` when its client left; a streamed
    one, the common case, was not, so a dashboard of abandoned answers saw none."""
    with server.client() as client:
        stream_id = _create(client)
        client.post(f"/v1/streams/{stream_id}/frames", content=_png(random_frames(1, 3, *SIZE)[0]),
                    headers={"Content-Type": "image/png"}).raise_for_status()
        chat = {"model": "builtin", "max_tokens": 512, "stream": True, "statekv": {"stream_id": stream_id},
                "messages": [{"role": "user", "content": QUESTION}]}
        ask = {"question": QUESTION, "max_new_tokens": 512, "stream": True}
        for route, path, body, short in (
                ("POST /v1/chat/completions", "/v1/chat/completions", chat, {**chat, "max_tokens": 2}),
                ("POST /v1/streams/{stream_id}/ask", f"/v1/streams/{stream_id}/ask", ask,
                 {**ask, "max_new_tokens": 2})):
            before = _errors_counted(client, 499, route)
            with server.client() as leaving, leaving.stream("POST", path, json=body) as events:
                assert events.status_code == 200
                next(line for line in events.iter_lines() if line.startswith("data: "))  # then the client leaves
            deadline = time.monotonic() + 60
            while _errors_counted(client, 499, route) == before and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _errors_counted(client, 499, route) == before + 1, route
            finished = client.post(path, json=short)  # streamed too, and read whole
            assert finished.status_code == 200 and _errors_counted(client, 499, route) == before + 1
        client.delete(f"/v1/streams/{stream_id}").raise_for_status()


def test_odd_requests_are_one_line_client_errors_never_server_faults(server):
    """A file URL urllib cannot parse, a client gone before its body was whole, names of any length, a watch question
    too long, retrieve asked of a method that retrieves nothing, sinks that overflow with the prompt, an empty form."""
    frames_route = "POST /v1/streams/{stream_id}/frames"
    with server.client() as client:
        stream_id = _create(client)
        for url in ("file://[::1/v.mp4", "file://\u2100/v.mp4"):
            asked = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                              {"type": "text", "text": QUESTION}]}]}
            assert "is not a URL" in _error(client.post("/v1/chat/completions", json=asked), 400)
        faults = _errors_counted(client, 500, frames_route)
        with socket.create_connection(("127.0.0.1", server.port)) as gone:  # a camera's upload cut off
            gone.sendall(f"POST /v1/streams/{stream_id}/frames HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}"
                         "\r\nContent-Type: image/png\r\nContent-Length: 100000\r\n\r\n".encode() + b"x" * 10)
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        while _errors_counted(client, 499, frames_route) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _errors_counted(client, 499, frames_route) >= 1
        assert _errors_counted(client, 500, frames_route) == faults
        assert "ClientDisconnect" not in server.printed()
        for route in ("/v1/streams", f"/v1/streams/{stream_id}/ask", f"/v1/streams/{stream_id}/watches"):
            message = _error(client.post(route, json={"x" * 100_000: 1}), 400)  # as JSON spells it, cut short
            assert len(message) < 300 and ' "xxxxxxxx' in message, message
        long = "h" * 100_000
        for url in (f"file://\u2100{long}/v.mp4", f"file://{long}/v.mp4", f"{long}://x/v.mp4"):
            asked = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                              {"type": "text", "text": QUESTION}]}]}
            assert len(_error(client.post("/v1/chat/completions", json=asked), 400)) < 300
        assert len(_error(client.post("/v1/streams", json={"method": long}), 400)) < 300
        assert len(_error(client.post(f"/v1/streams/{stream_id}/ask", content=b"{}",
                                      headers={"Content-Type": f"text/{long}"}), 415)) < 300
        assert '"q\\u00e9\'\\n"' in _error(client.post(f"/v1/streams/{stream_id}/ask", json={"q\u00e9'\n": 1}), 400)
        client.post(f"/v1/streams/{stream_id}/frames", content=_png(random_frames(1, 5, *SIZE)[0]),
                    headers={"Content-Type": "image/png"}).raise_for_status()
        unbounded = _create(client, horizon_frames=None)
        too_long = client.post(f"/v1/streams/{unbounded}/watches", json={"question": "a" * 7000, "every": 1})
        assert too_long.status_code == 413 and too_long.json()["error"]["type"] == "request_too_large", too_long.text
        recent = _create(client, method="simplestream")
        client.post(f"/v1/streams/{recent}/frames", content=_png(random_frames(1, 6, *SIZE)[0]),
                    headers={"Content-Type": "image/png"}).raise_for_status()
        assert "retrieve=2 is not used by method='simplestream'" in _error(
            client.post(f"/v1/streams/{recent}/ask", json={"question": QUESTION, "retrieve": 2}), 400)
        message = _error(client.post("/v1/streams", json={"method": "rekv", "sinks": 2**48 - 2}), 400)
        assert "sinks" in message and "protect_tokens" not in message, message
        empty = client.post("/v1/streams", content=b"", headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert empty.status_code == 201, empty.text
        for made in (stream_id, unbounded, recent, empty.json()["id"]):
            client.delete(f"/v1/streams/{made}").raise_for_status()


def test_files_fed_at_once_step_together_and_answer_as_alone(server, qa, media):
    """Two clients each feed a file into a stream (budget 64 tokens: steady from the 17th frame): their pushes
    share batched steps, counted in statekv_batched_steps_total, and each answer is its stream's alone."""
    def batched() -> float:
        with server.client() as client:
            text = client.get("/metrics").text
        return float(re.search(r"^statekv_batched_steps_total (\S+)$", text, re.MULTILINE).group(1))

    before = batched()
    videos = sorted((media / "pair" / "videos").glob("*.mp4"))

    def feed(video: Path) -> str:
        with server.client() as client:
            stream_id = _create(client, horizon_frames=64, max_fps=1.0)
            fed = client.post(f"/v1/streams/{stream_id}/frames", json={"source": str(video.relative_to(media))})
            assert fed.status_code == 200 and fed.json()["kept"] == 40, fed.text
            answer = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION,
                                                                       "max_new_tokens": NEW_TOKENS})
            client.delete(f"/v1/streams/{stream_id}").raise_for_status()
            return answer.json()["answer"]

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(feed, videos))
    for video, answer in zip(videos, answers):
        with qa.stream(horizon_frames=64, max_fps=1.0) as alone:
            for frame in open_video(video).sample_at_rate(1.0):
                alone.push(frame)
            assert answer == alone.ask(QUESTION, max_new_tokens=NEW_TOKENS)
    assert batched() > before


def _refusal_in_the_docs() -> str:
    serving = (REPO / "docs" / "serving.md").read_text()
    return re.search(r"```text\n(statekv serve: error: the state folder .*?)\n```", serving, re.DOTALL).group(1)


def test_a_key_made_for_the_state_folder_outlives_restarts_and_unowned_streams_stop_a_start(tmp_path, media):
    state = tmp_path / "state"
    first = Server(state, media, "--no-page", keys=()).start()
    try:
        key = re.search(r"API key (\S+) \(made for", first.printed()).group(1)
        assert f"/?key={key}" in first.printed()
        stored = (state / "keys.json").read_text()
        assert key not in stored and json.loads(stored)["keys"][0]["owner"]  # only its digest is kept
        with first.client(key) as client:
            made_stream = _create(client)
            client.post(f"/v1/streams/{made_stream}/frames", content=_png(random_frames(1, 3, *SIZE)[0]),
                        headers={"Content-Type": "image/png"}).raise_for_status()
    finally:
        first.stop()
    again = Server(state, media, "--no-page", keys=()).start()  # the same folder, no key given: the made key is reused
    try:
        assert key not in again.printed() and "using the API key made for" in again.printed()
        assert f"statekv serve: brought back 1 stream from {state}" in again.printed()  # before: the log said nothing
        with again.client(key) as client:
            listed = client.get("/v1/streams").json()["data"]
        assert [(s["id"], s["frames"], s["state"]) for s in listed] == [(made_stream, 1, "ready")]
    finally:
        again.stop()
    flagged = Server(state, media, "--no-page", keys=("flag-key",)).start()  # a key given: the made one stays valid too
    try:
        with flagged.client(key) as client:
            assert [s["id"] for s in client.get("/v1/streams").json()["data"]] == [made_stream]
        with flagged.client("flag-key") as client:
            flag_stream = _create(client)
    finally:
        flagged.stop()
    (state / "keys.json").unlink()  # the made key retired: its stream has no key any more
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("STATEKV_API_KEYS", None)
    command = [sys.executable, "-m", "statekv.cli", "serve", "--port", "0", "--state-dir", "state",
               "--api-key", "flag-key"]
    refused = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip() == _refusal_in_the_docs(), refused.stderr
    dropped = Server(state, media, "--no-page", "--drop-unowned-streams", keys=("flag-key",)).start()
    try:
        with dropped.client("flag-key") as client:
            assert [s["id"] for s in client.get("/v1/streams").json()["data"]] == [flag_stream]
        assert not list((state / "streams").glob(f"{made_stream}*"))
    finally:
        dropped.stop()


def _serve(folder: Path, *arguments: str) -> subprocess.CompletedProcess:
    """``statekv serve --model builtin ...`` run in ``folder`` without a key in the environment, to its end."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("STATEKV_API_KEYS", None)
    command = [sys.executable, "-m", "statekv.cli", "serve", "--model", "builtin", *arguments]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, env=env, timeout=120)


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in folder.rglob("*") if path.is_file()}


def test_a_start_that_is_refused_makes_no_key(tmp_path):
    """A new user's first start goes wrong (a model that is not there): the folder gets no key, so the start that
    works afterwards makes and shows the one key (before, the refused start kept a key nobody had seen)."""
    refused = _serve(tmp_path, "--port", "0", "--state-dir", "state", "--model", str(tmp_path / "no-such-model"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "API key" not in refused.stdout and not (tmp_path / "state" / "keys.json").exists()


def test_a_second_server_on_a_state_folder_stops_at_once_writing_nothing(tmp_path, media):
    state = tmp_path / "state"
    first = Server(state, media, "--no-page", "--save-every-seconds", "3600", keys=()).start()
    key = re.search(r"API key (\S+) \(made for", first.printed()).group(1)
    try:
        with first.client(key) as client:
            stream = _create(client)
            for frame in random_frames(3, 5, *SIZE):
                client.post(f"/v1/streams/{stream}/frames", content=_png(frame),
                            headers={"Content-Type": "image/png"}).raise_for_status()
        before = _files(state)
        refused = _serve(tmp_path, "--port", "0", "--state-dir", str(state))  # the folder's key: it could serve it
        assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
        assert refused.stderr.count("\n") == 1 and refused.stderr.startswith(
            f"statekv serve: error: the state folder {state} is in use by statekv serve on {first.url} (process "
            f"{first.process.pid} on "), refused.stderr
        assert refused.stderr.rstrip().endswith("one state folder has one server: stop that one, or give this one "
                                                "another --state-dir")
        assert _files(state) == before
        assert httpx.get(f"{first.url}/health", timeout=10).status_code == 200
    finally:  # its terminal closes: SIGHUP stops it as SIGTERM does (before: a traceback, the requests cut)
        first.process.send_signal(signal.SIGHUP)
        with contextlib.suppress(subprocess.TimeoutExpired):
            first.process.wait(timeout=30)
        first.stop()
    assert first.process.returncode == 128 + signal.SIGHUP
    assert "Traceback" not in first.printed() and first.printed().splitlines()[-1] == "statekv serve: stopped by SIGHUP"
    again = Server(state, media, "--no-page", keys=()).start()  # the lock went with its server
    try:
        with again.client(key) as client:
            listed = client.get("/v1/streams").json()["data"]
        assert [(s["id"], s["frames"]) for s in listed] == [(stream, 3)]  # the first server's frames, all kept
    finally:
        again.stop()


@pytest.mark.parametrize("ignored", ["SIGINT", "SIGHUP", None])
def test_the_server_stops_gracefully_on_every_stopping_signal_it_was_not_started_ignoring(ignored):
    """uvicorn catches SIGINT and SIGTERM itself to end its loop; the server catches SIGHUP alike, and leaves a
    signal it was started ignoring ignored (``nohup``, a shell's background)."""
    import uvicorn

    from statekv.serve.server import AppServer

    server = AppServer.__new__(AppServer)  # its signal handling alone: no app
    uvicorn.Server.__init__(server, uvicorn.Config(app=None))
    numbers = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {number: signal.getsignal(number) for number in numbers}  # put back after the test
    try:
        for number in numbers:  # as from a terminal, whatever the runner ignores
            signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)
        if ignored:
            signal.signal(getattr(signal, ignored), signal.SIG_IGN)
        before = {number: signal.getsignal(number) for number in numbers}
        with server.capture_signals():
            inside = {number.name: signal.getsignal(number) for number in numbers}
        assert {number: signal.getsignal(number) for number in numbers} == before
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    assert inside == {name: signal.SIG_IGN if name == ignored else server.handle_exit
                      for name in ("SIGINT", "SIGTERM", "SIGHUP")}


def test_a_feed_the_server_stops_answers_how_to_go_on_and_goes_on_from_there(tmp_path):
    """Before: Ctrl-C during a feed of a file waited out the graceful shutdown, then cancelled the feed's request
    (a plain-text 500, a traceback in the log), and a feed could only start the file over."""
    media = tmp_path / "media"
    media.mkdir()
    write_test_video(media / "long.mp4", frames=3000, fps=25)  # 120 s: 240 frames at 2 fps
    state = tmp_path / "state"
    server = Server(state, media, "--no-page", "--save-every-seconds", "3600").start()
    answers = []
    try:
        with server.client() as client:
            stream = _create(client, max_fps=2.0, horizon_frames=None)
            feeding = threading.Thread(target=lambda: answers.append(client.post(
                f"/v1/streams/{stream}/frames", json={"source": "long.mp4"})))
            feeding.start()
            deadline = time.monotonic() + 60
            while (client.get(f"/v1/streams/{stream}").json().get("feed") or {}).get("offered", 0) < 20:
                assert time.monotonic() < deadline and feeding.is_alive()
                time.sleep(0.1)
            server.process.send_signal(signal.SIGINT)
            feeding.join(timeout=60)
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(timeout=30)
        server.stop()
    assert server.process.returncode == 130 and "Traceback" not in server.printed()
    message = _error(answers[0], 503)
    skip = int(re.search(r'"skip": (\d+)\}', message).group(1))
    assert message.startswith("the server is stopping: feeding long.mp4 stopped after ") and 20 <= skip < 240
    again = Server(state, media, "--no-page").start()
    try:
        with again.client() as client:
            assert client.get(f"/v1/streams/{stream}").json()["frames"] == skip  # every frame fed was saved
            fed = client.post(f"/v1/streams/{stream}/frames", json={"source": "long.mp4", "skip": skip}).json()
            # as one feed: every frame kept on its own tick (the file's frames lie just after theirs), none twice
            assert (fed["offered"], fed["kept"], fed["frames"]) == (240 - skip, 240 - skip, 240)
            assert fed["seconds"] == pytest.approx(119.52)
            _error(client.post(f"/v1/streams/{stream}/frames", json={"source": "long.mp4", "skip": -1}), 400)
    finally:
        again.stop()


def test_a_second_ctrl_c_stops_the_server_at_once_in_one_line_and_its_streams_are_saved(tmp_path, media):
    """Before: a second Ctrl-C had uvicorn skip the app's shutdown, whose task was cancelled as the loop ended: the
    streams were saved then, but the log showed a traceback of the lifespan protocol."""
    state = tmp_path / "state"
    server = Server(state, media, "--no-page", "--save-every-seconds", "3600", "--save-every-frames", "100000")
    server.start()
    try:
        with server.client() as client:
            stream = _create(client, horizon_frames=None)
            for seed in range(3):
                pushed = client.post(f"/v1/streams/{stream}/frames", content=_png(np.full((32, 32, 3), seed * 80,
                                     np.uint8)), headers={"Content-Type": "image/png"})
                assert pushed.status_code == 200, pushed.text
        server.process.send_signal(signal.SIGINT)
        time.sleep(0.02)
        server.process.send_signal(signal.SIGINT)
        server.process.wait(timeout=30)
    finally:
        server.stop()
    printed = server.printed()
    assert server.process.returncode == 130 and "Traceback" not in printed, printed[-3000:]
    again = Server(state, media, "--no-page").start()
    try:
        with again.client() as client:
            assert client.get(f"/v1/streams/{stream}").json()["frames"] == 3
    finally:
        again.stop()


def test_a_port_in_use_or_a_host_not_of_this_machine_stops_a_start_at_once(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = _serve(tmp_path, "--host", "127.0.0.1", "--port", str(port), "--state-dir", "state")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr == (f"statekv serve: error: cannot listen on 127.0.0.1:{port}: "
                              f"{os.strerror(errno.EADDRINUSE)}; another process listens there: stop it, or give "
                              "another --port (0 picks a free one)\n")
    assert not (tmp_path / "state").exists()  # no folder, no key: the model never loaded either
    elsewhere = _serve(tmp_path, "--host", "203.0.113.7", "--port", "0", "--state-dir", "state")  # TEST-NET-3
    assert elsewhere.returncode == 2 and elsewhere.stdout == "", elsewhere.stdout + elsewhere.stderr
    assert elsewhere.stderr.count("\n") == 1 and elsewhere.stderr.startswith(
        "statekv serve: error: cannot listen on 203.0.113.7:0: "), elsewhere.stderr
    assert not (tmp_path / "state").exists()


def test_a_slow_client_does_not_hold_up_others(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as slow:
        slow.sendall(f"POST /v1/streams HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"hori".encode())
        started = time.monotonic()
        with server.client() as client:
            assert client.get("/v1/streams").status_code == 200
        assert time.monotonic() - started < 5


def test_sixteen_concurrent_clients_get_the_answers_of_streams_alone(server, qa):
    """With a budget of one frame the streams are steady from their second frame: concurrent pushes share
    batched steps, and every answer is still that of its stream alone."""
    def client_run(seed: int) -> tuple[list[np.ndarray], str]:
        frames = random_frames(4, seed, *SIZE)
        with server.client() as client:
            stream_id = _create(client, budget=BATCHED_BUDGET)
            for index, image in enumerate(frames):
                pushed = client.post(f"/v1/streams/{stream_id}/frames?t={index}", content=_png(image),
                                     headers={"Content-Type": "image/png"})
                assert pushed.status_code == 200, pushed.text
            answer = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION,
                                                                       "max_new_tokens": NEW_TOKENS})
            assert answer.status_code == 200, answer.text
            client.delete(f"/v1/streams/{stream_id}").raise_for_status()
        return frames, answer.json()["answer"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(client_run, range(100, 116)))  # any error fails here
    answers = [answer for _, answer in results]
    small = qa.with_options(budget=BATCHED_BUDGET)
    assert answers == [_alone(small, frames) for frames, _ in results]
    with server.client() as client:
        metrics = client.get("/metrics").text
    assert "statekv_frames_total" in metrics and "statekv_ask_seconds_bucket" in metrics
    batched = re.search(r"^statekv_batched_steps_total (\S+)$", metrics, re.MULTILINE)
    assert batched and float(batched.group(1)) > 0  # some streams' steps ran in one forward
    quiet = re.search(r"^statekv_quiet_catch_up_steps_total (\S+)$", metrics, re.MULTILINE)
    assert quiet and float(quiet.group(1)) == 0  # no stream came near the model's range


def test_limits_answer_429_with_retry_after(server):
    with server.client() as client:
        stream_id = _create(client)
        client.post(f"/v1/streams/{stream_id}/frames", content=_png(random_frames(1, 3, *SIZE)[0]),
                    headers={"Content-Type": "image/png"}).raise_for_status()

        asks = 48  # three times --max-asks, sent at once (24 sent as the pool started them were once all let in)
        together = threading.Barrier(asks)

        def ask(_):
            together.wait(timeout=30)
            return client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 24})

        with ThreadPoolExecutor(asks) as pool:
            replies = list(pool.map(ask, range(asks)))
        refused = [reply for reply in replies if reply.status_code == 429]
        assert refused and all(reply.headers["retry-after"].isdigit() for reply in refused)
        assert all(reply.status_code == 200 for reply in replies if reply.status_code != 429)
        created = []
        while True:
            reply = client.post("/v1/streams", json={"horizon_frames": 4})
            if reply.status_code == 429:
                assert reply.headers["retry-after"].isdigit()
                break
            assert reply.status_code == 201 and len(created) < 30
            created.append(reply.json()["id"])
        for other in created + [stream_id]:
            client.delete(f"/v1/streams/{other}").raise_for_status()


def launched_chromium(playwright, *extra: str):
    """Debian's chromium, headless, through Playwright (the page tests' browser), with ``extra`` arguments."""
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
        "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--no-first-run", *extra])


@contextlib.contextmanager
def chromium_browser(*extra: str):
    """`launched_chromium` in a Playwright of its own, closed on leaving; the test is skipped where chromium is
    missing."""
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = launched_chromium(playwright, *extra)
        try:
            yield browser
        finally:
            browser.close()


def _shown(page, selector: str) -> str:
    page.wait_for_selector(selector, state="visible", timeout=60_000)
    return page.inner_text(selector)


def _gone(page, selector: str) -> bool:
    """Whether ``selector`` is hidden, once the server's update reached the page (NiceGUI runs a click's handler on
    the server, so the page changes a round trip after it); False if it is still shown after a minute."""
    from playwright.sync_api import TimeoutError as Timeout

    try:
        page.wait_for_selector(selector, state="hidden", timeout=60_000)
    except Timeout:
        return False
    return True


def _note(page, name: str, containing: str) -> str:
    """The text of the page's error note ``name`` once it says ``containing``."""
    selector = f".statekv-error-{name}:visible .statekv-error-message"
    page.wait_for_selector(f"{selector}:has-text({json.dumps(containing)})", timeout=60_000)
    return page.inner_text(selector)


def _frames_fed(page) -> int:
    found = re.search(r": (\d+) of", page.inner_text(".statekv-progress"))
    return int(found.group(1)) if found else 0


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_page_driven_as_a_new_user_would(server, qa, media, tmp_path):
    """A wrong key, bad files, no camera, a long file fed with its progress, a question with its busy state and
    latency, a question over the limit, a reload, a second tab, a restart, a delete: each state photographed
    (``STATEKV_SCREENSHOTS=docs/figures`` writes the docs' pictures)."""
    from statekv.serve.page import PAGE_NEW_TOKENS

    sync_api = pytest.importorskip("playwright.sync_api")
    shots = Path(os.environ.get("STATEKV_SCREENSHOTS") or tmp_path)
    with server.client() as client:
        before = {s["id"] for s in client.get("/v1/streams").json()["data"]}
    with sync_api.sync_playwright() as playwright:
        browser = launched_chromium(playwright)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            uploader = ".statekv-upload-new input[type=file]"
            page.goto(f"{server.url}/?key=not-a-key")  # a wrong key is refused at once, before any upload
            assert "unknown API key" in _note(page, "key", "unknown API key")
            assert "disabled" in page.get_attribute(".statekv-upload-new", "class")
            page.get_by_label("API key").fill(KEY)
            page.get_by_role("button", name="use key").click()
            _shown(page, ".statekv-key-status:has-text('key accepted')")
            assert _gone(page, ".statekv-error-key")

            page.set_input_files(uploader, str(media / "not-a-video.mp4"))  # undecodable: no stream is made
            message = _note(page, "upload", "not-a-video.mp4")
            assert "not a readable video file" in message and str(media) not in message
            uploads = server.state / "uploads"  # the state folder cannot keep an upload: shown, nothing left
            shutil.rmtree(uploads, ignore_errors=True)
            uploads.write_text("in the way")
            page.set_input_files(uploader, str(_video(media)))
            message = _note(page, "upload", "cannot keep the uploaded")
            assert str(server.state) not in message and uploads.read_text() == "in the way"
            uploads.unlink()
            notes = tmp_path / "notes.txt"
            notes.write_text("not a video")
            page.set_input_files(uploader, str(notes))  # refused in the browser, with its type
            assert "notes.txt is not a video (text/plain)" in _note(page, "upload", "notes.txt")
            page.get_by_role("button", name="from the camera").click()  # headless Chromium has no camera
            assert "no camera" in _note(page, "camera", "no camera")
            page.screenshot(path=str(shots / "serve-errors.png"))
            with server.client() as client:
                assert {s["id"] for s in client.get("/v1/streams").json()["data"]} == before
            page.click(".statekv-error-camera button")  # dismissed, it goes; the others stay
            assert _gone(page, ".statekv-error-camera") and page.is_visible(".statekv-error-upload")

            page.set_input_files(uploader, str(media / "long" / "videos" / "v0000.mp4"))  # 120 frames
            _shown(page, ".statekv-progress:has-text('of 120 frames')")
            page.wait_for_function("() => /: ([3-9]\\d|\\d{3}) of/.test("
                                   "document.querySelector('.statekv-progress').innerText)", timeout=60_000)
            assert page.get_attribute(".statekv-frame img", "src").startswith("data:image/jpeg")
            assert 30 <= _frames_fed(page) < 120 and "feeding" in page.inner_text(".statekv-state")
            page.screenshot(path=str(shots / "serve-feeding.png"))
            _shown(page, ".statekv-stats:has-text('120 frames ·')")

            page.set_input_files(uploader, str(_video(media)))  # a second stream; the first stays listed
            _shown(page, ".statekv-stats:has-text('12 frames ·')")
            assert page.locator(".statekv-stream").count() == len(before) + 2
            stream_id = re.search(r"stream=(st_[0-9a-f]+)", page.url).group(1)
            page.evaluate("""() => { window.busySeen = false;
                const box = document.querySelector('.statekv-asking');
                new MutationObserver(() => { if (box.offsetParent !== null) window.busySeen = true; })
                    .observe(box, {attributes: true, attributeFilter: ['style', 'class']}); }""")
            page.get_by_label("Question").fill(QUESTION)
            page.get_by_role("button", name="Ask").click()
            shown = _shown(page, ".statekv-answer")
            when = page.inner_text(".statekv-answer-time")
            assert page.evaluate("window.busySeen")  # "answering..." was shown while it was answered
            assert shown == qa.answer(_video(media), QUESTION, max_new_tokens=PAGE_NEW_TOKENS)
            assert re.fullmatch(r"at 11\.0 s \(12 frames\) · answered in \d+\.\d\d s", when), when
            page.screenshot(path=str(shots / "serve-page.png"), full_page=True)

            page.get_by_label("Question").fill("x" * 20_000)  # the page's limits are the API's
            page.get_by_role("button", name="Ask").click()
            assert "characters, over the limit of 8000" in _note(page, "ask", "over the limit")  # with the options added

            page.reload()  # lands back on the stream, with its answer
            assert _shown(page, ".statekv-answer") == shown and f"stream={stream_id}" in page.url
            other = context.new_page()  # a second tab: the browser remembers the key and the stream
            other.goto(f"{server.url}/")
            assert _shown(other, ".statekv-answer") == shown
            other.get_by_label("Question").fill(OPEN_QUESTION)
            other.get_by_role("button", name="Ask").click()
            page.wait_for_function("() => document.querySelectorAll('.statekv-answer').length == 2",
                                   timeout=60_000)  # the first tab sees it too

            with server.client() as client:
                metrics = client.get("/metrics").text
            asked = re.search(r'^statekv_asks_total\{route="page"\} (\S+)$', metrics, re.MULTILINE)
            for tab in (page, other):
                tab.evaluate("window.beforeRestart = true")
            server.stop()  # a restart: each tab reconnects, reloads and finds its stream again
            server.start()
            for tab in (page, other):  # both reloaded on their own (a reload of ours meanwhile would be aborted)
                tab.wait_for_function("() => window.beforeRestart === undefined && "
                                      "document.querySelectorAll('.statekv-answer').length == 2", timeout=120_000)
            assert page.inner_text(".statekv-title") == "v0000.mp4" and f"stream={stream_id}" in page.url
            other.reload()
            other.locator(f".statekv-stream-{stream_id}").get_by_role("button", name="delete").click()
            other.get_by_role("button", name="delete it").click()
            _shown(page, ".statekv-status:has-text('was deleted')")  # the first tab is told
        finally:
            browser.close()
    with server.client() as client:
        assert stream_id not in {s["id"] for s in client.get("/v1/streams").json()["data"]}
    assert asked and float(asked.group(1)) == 2  # the page's two questions, counted before the restart


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_page_offers_the_choices_watches_and_shows_what_each_answer_read(server, qa, media, tmp_path):
    """A new user of the built-in model: told what it answers, its example question asked with the options the
    page offers (before: "square red red red..."), the frames the answer read, a watch added and answering as a
    second video is fed, a long question's error in view, and after a restart the frame and the chart are back
    (before: no frame, an empty history)."""
    from statekv.serve.page import PAGE_NEW_TOKENS
    from statekv.synthetic.prompts import question_prompt

    sync_api = pytest.importorskip("playwright.sync_api")
    shots = Path(os.environ.get("STATEKV_SCREENSHOTS") or tmp_path)
    with sync_api.sync_playwright() as playwright:
        browser = launched_chromium(playwright)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
            page.goto(f"{server.url}/?key={KEY}")
            _shown(page, ".statekv-key-status:has-text('key accepted')")
            page.set_input_files(".statekv-upload-new input[type=file]", str(_video(media)))
            _shown(page, ".statekv-stats:has-text('12 frames ·')")
            assert "multiple-choice" in _shown(page, ".statekv-choices-hint")
            example = page.get_attribute(".statekv-question textarea", "placeholder")
            assert example == "What colour was the circle?"
            page.get_by_label("Question").fill(example)  # the question alone: the page adds the options shown
            page.get_by_role("button", name="Ask").click()
            answer = _shown(page, ".statekv-answer")
            composed = question_prompt(example, ["red", "green", "blue", "yellow"])
            assert answer == qa.answer(_video(media), composed, max_new_tokens=PAGE_NEW_TOKENS) and answer in "ABCD"
            assert page.inner_text(".statekv-answer-read") == "read every frame held (12)"

            page.get_by_label("Watch for").fill("Which came first, red or blue?")
            page.get_by_label("every (frames)").fill("4")
            page.get_by_role("button", name="Watch").click()
            _shown(page, ".statekv-watch-line:has-text('every 4 frames · 1 evaluations')")  # answered when made
            assert _shown(page, ".statekv-watch-answer") in "ABCD"
            page.set_input_files(".statekv-upload-more input[type=file]", str(media / "pair" / "videos" / "v0000.mp4"))
            page.wait_for_selector(".statekv-watch-line:has-text('11 evaluations')", timeout=120_000)  # 40 more
            stream_id = re.search(r"stream=(st_[0-9a-f]+)", page.url).group(1)
            with server.client() as client:
                watches = client.get(f"/v1/streams/{stream_id}/watches").json()["data"]
            assert len(watches) == 1 and watches[0]["evaluations"] == 11 and watches[0]["events"]
            page.screenshot(path=str(shots / "serve-watches.png"), full_page=True)

            page.get_by_label("Question").fill("x" * 20_000)  # a long question: its error is in view, not below it
            page.evaluate("window.scrollTo(0, 0)")  # as the person left it: the question box at the screen's foot
            page.get_by_role("button", name="Ask").click()
            _note(page, "ask", "over the limit")
            page.wait_for_function("() => { const box = document.querySelector('.statekv-error-ask')"
                                   ".getBoundingClientRect(); return box.top >= 0 && box.bottom <= innerHeight + 1; }",
                                   timeout=30_000)

            page.evaluate("window.beforeRestart = true")
            server.stop()
            server.start()
            page.wait_for_function("() => window.beforeRestart === undefined && "
                                   "document.querySelectorAll('.statekv-watch').length == 1", timeout=120_000)
            assert page.get_attribute(".statekv-frame img", "src").startswith("data:image/jpeg")
            with server.client() as client:
                assert len(client.get(f"/v1/streams/{stream_id}/history").json()["history"]) == 52
        finally:
            browser.close()


def test_a_streams_record_keeps_the_whole_history_its_history_route_shows():
    """A stream kept 2,000 points of history for ``GET /v1/streams/{id}/history`` and its record only the last 500,
    so a restart cut a long stream's history to a quarter."""
    from statekv.serve.page_record import HISTORY, page_fields, recall_page

    points = [{"seconds": float(index), "frames": index + 1, "tokens": 6 * index, "carried": 64, "cache_bytes": index}
              for index in range(HISTORY)]

    def entry(history: list) -> SimpleNamespace:
        return SimpleNamespace(id="st_1", history=history, last_frame=None, feed=None,
                               stream=SimpleNamespace(frames=HISTORY))

    restarted = entry([])
    recall_page(restarted, json.loads(json.dumps(page_fields(entry(list(points))))))
    assert HISTORY >= 2000 and restarted.history == points


def test_a_page_feed_cut_twice_counts_the_files_frames_and_skips_only_for_the_same_file():
    """The review's cases: a file fed again (skipping 60 frames) and cut again was said to be held "the first 90 of
    its 40 frames"; and another file of the same name would have been skipped into."""
    from statekv.serve.feeding import Feed
    from statekv.serve.page_record import recall_page

    again = Feed("clip.mp4", 40, resumable=False, skip=60, held_before=0, size=1234)  # a 100-frame file, fed again
    entry = SimpleNamespace(id="st_1", stream=SimpleNamespace(frames=90), history=[], feed=None, last_frame=None)
    recall_page(entry, {"history": [], "feed": again.recorded()})
    assert "the stream holds the first 90 of its 100 frames" in entry.feed.error, entry.feed.error
    assert entry.feed.rest_of("clip.mp4", 1234, 90) == 90
    assert entry.feed.rest_of("clip.mp4", 999, 90) == 0 and entry.feed.rest_of("other.mp4", 1234, 90) == 0
    assert "held_before" not in again.describe()  # the API's feed is as it was
    # a feed that ended here (stopped as asked, or failed) knows what it fed: frames pushed since are not the file's
    # (before: 10 frames pushed after a stop at 31 made the file's frames 31 to 40 skipped when it was added again)
    stopped = Feed("clip.mp4", 240, offered=31, kept=31, running=False, error="stopped as asked", stopped=True,
                   resumable=False, held_before=0, size=1234)
    assert stopped.rest_of("clip.mp4", 1234, 41) == 31
    recalled = SimpleNamespace(id="st_2", stream=SimpleNamespace(frames=41), history=[], feed=None, last_frame=None)
    recall_page(recalled, {"history": [], "feed": stopped.recorded()})
    assert recalled.feed.stopped and recalled.feed.rest_of("clip.mp4", 1234, 41) == 31


def test_kill_9_under_load_then_restart_keeps_all_but_the_unsaved_tail(server, qa):
    """Saved every 2 frames: after 3 pushes a stream holds 2 on disk; kill -9 while other clients push."""
    frames = {seed: random_frames(3, seed, *SIZE) for seed in (201, 202)}
    ids = {}
    with server.client() as client:
        for seed, images in frames.items():
            ids[seed] = _create(client, budget=64)
            for index, image in enumerate(images):
                client.post(f"/v1/streams/{ids[seed]}/frames?t={index}", content=_png(image),
                            headers={"Content-Type": "image/png"}).raise_for_status()
        asked = client.post(f"/v1/streams/{ids[201]}/ask", json={"question": QUESTION, "max_new_tokens": NEW_TOKENS})
        asked.raise_for_status()  # its record, with the page's history of 3 frames, is written; its save holds 2
        busy = _create(client)
    stop = threading.Event()

    def load():
        with server.client() as client:
            for index in range(16):
                if stop.is_set():
                    return
                try:
                    client.post(f"/v1/streams/{busy}/frames?t={index}", content=_png(random_frames(1, index, *SIZE)[0]),
                                headers={"Content-Type": "image/png"})
                except httpx.HTTPError:
                    return

    pusher = threading.Thread(target=load)
    pusher.start()
    time.sleep(1.0)
    server.kill()
    stop.set()
    pusher.join(timeout=30)
    server.start()
    with server.client() as client:
        listed = {s["id"]: s for s in client.get("/v1/streams").json()["data"]}
        assert busy in listed and listed[busy]["frames"] == listed[busy]["resume_from"] == listed[busy]["saved"]["frames"]
        for seed, images in frames.items():
            stats = listed[ids[seed]]
            assert stats["settings"]["budget"] == 64 and stats["horizon_frames"] == 16
            assert stats["frames"] == 2 and stats["resume_from"] == 2 and stats["resume_after_seconds"] == 1.0
            history = client.get(f"/v1/streams/{ids[seed]}/history").json()["history"]
            assert [point["frames"] for point in history] == [1, 2]  # not the lost third frame's point
            client.post(f"/v1/streams/{ids[seed]}/frames?t=2", content=_png(images[2]),
                        headers={"Content-Type": "image/png"}).raise_for_status()
            answer = client.post(f"/v1/streams/{ids[seed]}/ask",
                                 json={"question": QUESTION, "max_new_tokens": NEW_TOKENS}).json()["answer"]
            assert answer == _alone(qa.with_options(budget=64), images)
            assert client.get(f"/v1/streams/{ids[seed]}").json()["saved"]["frames"] == 2  # the third is unsaved
            history = client.get(f"/v1/streams/{ids[seed]}/history").json()["history"]
            assert [(point["frames"], point["seconds"]) for point in history] == [(1, 0), (2, 1), (3, 2)]
    server.stop()  # SIGTERM: a graceful shutdown saves every stream
    server.start()
    with server.client() as client:
        for seed in frames:
            stats = client.get(f"/v1/streams/{ids[seed]}").json()
            assert stats["frames"] == stats["saved"]["frames"] == stats["resume_from"] == 3
