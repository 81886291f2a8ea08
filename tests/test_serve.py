"""`statekv serve` with real parts: the server as a process on a loopback port, the built-in model, the official
`openai` client, concurrent clients, kill -9 and restart, and a real browser on the page.

Every answer the server gives is compared with the same stream run alone through the Python API.
"""

from __future__ import annotations

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

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")
from PIL import Image  # noqa: E402

import statekv  # noqa: E402
from statekv.video import open_video  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
KEY, OTHER_KEY = "test-key-one", "test-key-two"
QUESTION = "What colour was the triangle?\nA. red\nB. green\nC. blue\nD. yellow\nAnswer with the letter."
NEW_TOKENS = 6
BATCHED_BUDGET = 4  # tokens: one frame of the built-in model
OPEN_QUESTION = "What colour was the triangle?"  # answered at length (the letter question ends after one token)
START_SECONDS = 180
CHROMIUM = shutil.which("chromium")


# -- the server process ----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    def __init__(self, state: Path, media: Path, *extra: str):
        self.state, self.media, self.extra = state, media, extra
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> "Server":
        port = _free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("STATEKV_API_KEYS", None)
        self.log = open(self.state.parent / f"server-{port}.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "statekv.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--state-dir", str(self.state), "--media-root", str(self.media), "--api-key", KEY,
             "--api-key", OTHER_KEY, *self.extra], stdout=self.log, stderr=subprocess.STDOUT, env=env)
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
        raise AssertionError("the server did not start in time")

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

    def client(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    from statekv.cli import main

    assert main(["synthetic", "make", "--out", str(root / "held-out"), "--videos", "1", "--seed", "4242",
                 "--frames", "12"]) == 0
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
    return statekv.VideoQA.from_pretrained("builtin")


def _video(media: Path) -> Path:
    return media / "held-out" / "videos" / "v0000.mp4"


def _frames(seed: int, count: int) -> list[np.ndarray]:
    generator = np.random.default_rng(seed)
    return [generator.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(count)]


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
    with qa.stream(horizon_frames=64, max_fps=1.0) as alone:
        for frame in open_video(_video(media)).sample_at_rate(1.0):
            alone.push(frame)
        expected = alone.ask(QUESTION, max_new_tokens=NEW_TOKENS)
    assert answer.json() == {"answer": expected, "frames": 12, "seconds": 11.0, "id": stream_id}
    assert expected == qa.answer(_video(media), QUESTION, max_new_tokens=NEW_TOKENS)  # VideoQA.encode's answer
    assert stats["frames"] == 12 and stats["tokens"] > 12 and stats["carried"] > 0 and stats["cache_bytes"] > 0
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
            for image in _frames(7, 50):
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
        for index, image in enumerate(_frames(7, 2)):
            client.post(f"/v1/streams/{stream_id}/frames?t={index}", content=_png(image),
                        headers={"Content-Type": "image/png"}).raise_for_status()
        whole = client.post(f"/v1/streams/{stream_id}/ask", json={"question": OPEN_QUESTION, "max_new_tokens": NEW_TOKENS})
        with client.stream("POST", f"/v1/streams/{stream_id}/ask",
                           json={"question": OPEN_QUESTION, "max_new_tokens": NEW_TOKENS, "stream": True}) as events:
            assert events.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in events.iter_lines() if line.startswith("data: ")]
    pieces = [json.loads(line[6:]) for line in lines]
    tokens = [piece["token"] for piece in pieces[:-1]]
    assert len(tokens) >= 2 and pieces[-1] == whole.json()
    assert "".join(tokens).strip() == whole.json()["answer"]


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
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 0
        chat = {"model": "builtin", "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": outside.as_uri()}}, {"type": "text", "text": QUESTION}]}]}
        _error(client.post("/v1/chat/completions", json=chat), 403)
        chat["messages"][0]["content"][0]["video_url"]["url"] = "http://example.com/v.mp4"
        _error(client.post("/v1/chat/completions", json=chat), 400)


def test_the_openai_client_works_unchanged(server, qa, media):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    assert [model.id for model in client.models.list()] == ["builtin"]
    video = {"type": "video_url", "video_url": {"url": _video(media).as_uri()}}
    messages = [{"role": "user", "content": [video, {"type": "text", "text": QUESTION}]}]
    reply = client.chat.completions.create(model="builtin", messages=messages, max_tokens=NEW_TOKENS)
    expected = qa.answer(_video(media), QUESTION, max_new_tokens=NEW_TOKENS)
    assert reply.choices[0].message.content == expected
    chunks = client.chat.completions.create(model="builtin", messages=messages, max_tokens=NEW_TOKENS, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks).strip() == expected

    with server.client() as http:
        stream_id = _create(http)
        frames = _frames(11, 2)
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
        beyond = client.post("/v1/streams", json={"horizon_frames": 10**6})  # beyond the RoPE: bounded positions
        assert beyond.status_code == 201, beyond.text
        client.delete(f"/v1/streams/{beyond.json()['id']}").raise_for_status()
        _error(client.post(frames, content=b"hello", headers={"Content-Type": "text/plain"}), 415)
        _error(client.post(frames, content=b"\x89PNG\r\n\x1a\nbroken", headers={"Content-Type": "image/png"}), 400)
        jpeg = io.BytesIO()
        Image.fromarray(_frames(1, 1)[0]).save(jpeg, format="JPEG")
        _error(client.post(frames, content=jpeg.getvalue(), headers={"Content-Type": "image/png"}), 415)
        _error(client.post(f"{frames}?t=-1", content=jpeg.getvalue(), headers={"Content-Type": "image/jpeg"}), 400)
        _error(client.post(frames, content=b"x" * (1_200_000), headers={"Content-Type": "image/png"}), 413)
        huge = io.BytesIO()
        Image.new("L", (5000, 5000)).save(huge, format="PNG")  # small file, 25 million pixels decoded
        _error(client.post(frames, content=huge.getvalue(), headers={"Content-Type": "image/png"}), 413)
        _error(client.post(ask, json={"question": QUESTION}), 400)  # no frame yet
        _error(client.post(ask, json={"question": ""}), 400)
        _error(client.post(ask, json={"question": QUESTION, "max_new_tokens": 0}), 400)
        _error(client.post(ask, json={"question": QUESTION, "temperature": 2}), 400)
        _error(client.post("/v1/chat/completions", json={"messages": "hi"}), 400)
        _error(client.get("/v1/nothing-here"), 404)
        _error(client.put("/v1/streams"), 405)
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 0


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
        frames = _frames(seed, 4)
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


def test_limits_answer_429_with_retry_after(server):
    with server.client() as client:
        stream_id = _create(client)
        client.post(f"/v1/streams/{stream_id}/frames", content=_png(_frames(3, 1)[0]),
                    headers={"Content-Type": "image/png"}).raise_for_status()

        def ask(_):
            return client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 24})

        with ThreadPoolExecutor(24) as pool:
            replies = list(pool.map(ask, range(24)))
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


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_page_in_a_real_browser(server, qa, media):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--no-first-run"])
        try:
            page = browser.new_page()
            page.goto(f"{server.url}/?key={KEY}")
            page.set_input_files("input[type=file]", str(_video(media)))
            page.wait_for_selector(".statekv-stats:has-text('frames 12 ')", timeout=90_000)
            page.get_by_label("Question").fill(QUESTION)
            page.get_by_role("button", name="Ask").click()
            page.wait_for_selector(".statekv-answer", timeout=60_000)
            shown = page.inner_text(".statekv-answer")
            when = page.inner_text(".statekv-answer-time")
        finally:
            browser.close()
    from statekv.serve.page import PAGE_NEW_TOKENS

    assert shown == qa.answer(_video(media), QUESTION, max_new_tokens=PAGE_NEW_TOKENS)
    assert when.startswith("at 11.0 s (12 frames)")


def test_kill_9_under_load_then_restart_keeps_all_but_the_unsaved_tail(server, qa):
    """Saved every 2 frames: after 3 pushes a stream holds 2 on disk; kill -9 while other clients push."""
    frames = {seed: _frames(seed, 3) for seed in (201, 202)}
    ids = {}
    with server.client() as client:
        for seed, images in frames.items():
            ids[seed] = _create(client, budget=64)
            for index, image in enumerate(images):
                client.post(f"/v1/streams/{ids[seed]}/frames?t={index}", content=_png(image),
                            headers={"Content-Type": "image/png"}).raise_for_status()
        busy = _create(client)
    stop = threading.Event()

    def load():
        with server.client() as client:
            for index in range(16):
                if stop.is_set():
                    return
                try:
                    client.post(f"/v1/streams/{busy}/frames?t={index}", content=_png(_frames(index, 1)[0]),
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
            client.post(f"/v1/streams/{ids[seed]}/frames?t=2", content=_png(images[2]),
                        headers={"Content-Type": "image/png"}).raise_for_status()
            answer = client.post(f"/v1/streams/{ids[seed]}/ask",
                                 json={"question": QUESTION, "max_new_tokens": NEW_TOKENS}).json()["answer"]
            assert answer == _alone(qa.with_options(budget=64), images)
            assert client.get(f"/v1/streams/{ids[seed]}").json()["saved"]["frames"] == 2  # the third is unsaved
    server.stop()  # SIGTERM: a graceful shutdown saves every stream
    server.start()
    with server.client() as client:
        for seed in frames:
            stats = client.get(f"/v1/streams/{ids[seed]}").json()
            assert stats["frames"] == stats["saved"]["frames"] == stats["resume_from"] == 3
