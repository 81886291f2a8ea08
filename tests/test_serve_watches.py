"""The watch API of `statekv serve` (`statekv.serve.watch_routes`), on a server in this process with the built-in
model: creating, reading and deleting watches, their events as frames are pushed, the stream's server-sent
events, the metrics, watches surviving a restart with their stream, and bad requests."""

from __future__ import annotations

import io
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
uvicorn = pytest.importorskip("uvicorn")
from PIL import Image  # noqa: E402

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.serve import ServeConfig, create_app  # noqa: E402
from statekv.serve.server import AppServer  # noqa: E402
from statekv.synthetic.plans import plan_video  # noqa: E402
from statekv.synthetic.prompts import question_prompt  # noqa: E402
from statekv.synthetic.scenes import render  # noqa: E402
from statekv.synthetic.seeds import video_rng  # noqa: E402

KEY, OTHER_KEY = "watch-key-one", "watch-key-two"
# blue is shown at seconds 7 and 14: the built-in model's answer changes from 1 to 2 at the evaluation after it
COUNT = question_prompt("How many times did the video show blue?", ["1", "2", "3", "4"])


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_options(ModelOptions(model="builtin"))


@pytest.fixture(scope="module")
def pictures() -> list[bytes]:
    made = []
    for still in plan_video(video_rng(5151, 0), 24).stills:
        buffer = io.BytesIO()
        Image.fromarray(render(still)).save(buffer, format="PNG")
        made.append(buffer.getvalue())
    return made


class Running:
    """A server in this process on a free loopback port."""

    def __init__(self, state: Path, qa, disk: bool = False):
        options = ModelOptions(model="builtin")
        if disk:  # streams kept in disk-tier file sets: a restart resumes them there, their watches from records
            options = ModelOptions(model="builtin", offload="disk", offload_dir=str(state.parent / "tiers"))
            qa = qa.with_options(offload="disk", offload_dir=options.offload_dir)
        self.config = ServeConfig(options=options, state_dir=state, api_keys=(KEY, OTHER_KEY), page=False,
                                  save_every_seconds=600)
        self.app = create_app(self.config, qa=qa)
        # a following client left open by a failed test must not hold the stop (and hide the failure)
        self.server = AppServer(self.app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=30)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def client(self, key: str = KEY) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=120)
        assert not self.thread.is_alive()


def push(client, stream_id: str, pictures: list[bytes], start: int, stop: int) -> None:
    for k in range(start, stop):
        pushed = client.post(f"/v1/streams/{stream_id}/frames?t={k}", content=pictures[k],
                             headers={"Content-Type": "image/png"})
        assert pushed.status_code == 200, pushed.text


def metric(client, name: str) -> float:
    text = client.get("/metrics").text
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


@pytest.mark.parametrize("disk", [False, True])
def test_watches_over_http_report_events_follow_and_survive_a_restart(tmp_path, qa, pictures, disk):
    server = Running(tmp_path / "state", qa, disk)
    try:
        with server.client() as client:
            stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
            push(client, stream_id, pictures, 0, 3)
            made = client.post(f"/v1/streams/{stream_id}/watches",
                               json={"question": COUNT, "every": 3, "max_new_tokens": 4})
            assert made.status_code == 201 and made.json() == {"id": made.json()["id"]}
            watch_id = made.json()["id"]
            url = f"/v1/streams/{stream_id}/watches/{watch_id}"
            first = client.get(url).json()
            assert first["question"] == COUNT and first["every"] == 3 and first["evaluations"] == 1
            assert first["events"] == [{"frame": 3, "seconds": 2.0, "answer": first["answer"]}]

            heard: list[dict] = []
            following = threading.Event()

            def follow() -> None:
                with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events") as events:
                    following.set()
                    name = None
                    for line in events.iter_lines():
                        if line.startswith("event: "):
                            name = line[len("event: "):]
                        elif line.startswith("data: ") and name == "watch":
                            heard.append(json.loads(line[len("data: "):]))
                            if len(heard) >= 1:
                                return

            reader = threading.Thread(target=follow, daemon=True)
            reader.start()
            assert following.wait(30)
            time.sleep(0.2)
            before = metric(client, "statekv_watch_evaluations_total")
            frames = 3
            while not heard and frames < 21:  # until an evaluation changes the answer
                push(client, stream_id, pictures, frames, frames + 3)
                frames += 3
            reader.join(timeout=30)
            watch = client.get(url).json()
            assert metric(client, "statekv_watch_evaluations_total") - before == (frames - 3) // 3
            assert watch["evaluations"] == 1 + (frames - 3) // 3
            assert metric(client, "statekv_watch_events_total") == len(watch["events"])
            assert heard and heard[0]["watch"] == watch_id
            assert {key: heard[0][key] for key in ("frame", "seconds", "answer")} in watch["events"][1:]
            listed = client.get(f"/v1/streams/{stream_id}/watches").json()["data"]
            assert [each["id"] for each in listed] == [watch_id]
            history = client.get(f"/v1/streams/{stream_id}/history").json()["history"]
            assert len(history) == frames

        ended = threading.Event()  # a client still following when the server stops

        def follow_to_the_end() -> None:
            with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events") as events:
                for line in events.iter_lines():
                    following.set()
            ended.set()

        following.clear()
        threading.Thread(target=follow_to_the_end, daemon=True).start()
        assert following.wait(30)
        stopping = time.monotonic()
        server.stop()  # its feed ends at once: it does not hold the stop until the graceful timeout (30 s here)
        assert time.monotonic() - stopping < 10 and ended.wait(10)
    finally:
        server.stop()
    server = Running(tmp_path / "state", qa, disk)  # a restart: the watch comes back with its stream
    try:
        with server.client() as client:
            again = client.get(url).json()
            assert again["events"] == watch["events"] and again["evaluations"] == watch["evaluations"]
            assert client.get(f"/v1/streams/{stream_id}/history").json()["history"] == history  # the chart's too
            push(client, stream_id, pictures, frames, frames + 3)
            assert client.get(url).json()["evaluations"] == watch["evaluations"] + 1
            assert metric(client, "statekv_watch_evaluations_total") == 1  # reporting here again
            assert client.get(url, headers={"Authorization": f"Bearer {OTHER_KEY}"}).status_code == 404
            gone = client.delete(url)
            assert gone.status_code == 200 and gone.json()["deleted"] is True
            assert client.get(url).status_code == 404
            push(client, stream_id, pictures, frames + 3, frames + 6)
            assert client.get(f"/v1/streams/{stream_id}/watches").json()["data"] == []
    finally:
        server.stop()
    server = Running(tmp_path / "state", qa, disk)  # deleted stays deleted
    try:
        with server.client() as client:
            assert client.get(url).status_code == 404
    finally:
        server.stop()


def test_bad_watch_requests_get_one_line(tmp_path, qa, pictures):
    server = Running(tmp_path / "state", qa)
    try:
        with server.client() as client:
            stream_id = client.post("/v1/streams", json={}).json()["id"]
            for body, words in [({"question": COUNT}, "every"), ({"question": "", "every": 2}, "question"),
                                ({"question": COUNT, "every": 0}, "every"),
                                ({"question": COUNT, "every": 2, "every_seconds": 1}, "not both"),
                                ({"question": COUNT, "every": 2, "max_new_tokens": 0}, "max_new_tokens"),
                                ({"question": COUNT, "every": 2, "colour": "red"}, "unknown watch field")]:
                refused = client.post(f"/v1/streams/{stream_id}/watches", json=body)
                assert refused.status_code == 400 and words in refused.json()["error"]["message"], refused.text
            assert client.get(f"/v1/streams/{stream_id}/watches/w_nope").status_code == 404
            assert client.post("/v1/streams/st_" + "0" * 24 + "/watches",
                               json={"question": COUNT, "every": 2}).status_code == 404
            made = client.post(f"/v1/streams/{stream_id}/watches", json={"question": COUNT, "every": 2})
            assert made.status_code == 201  # a stream without frames: evaluated from its first frames on
            assert client.get(f"/v1/streams/{stream_id}/watches/{made.json()['id']}").json()["events"] == []
            push(client, stream_id, pictures, 0, 2)
            assert client.get(f"/v1/streams/{stream_id}/watches/{made.json()['id']}").json()["evaluations"] == 1
    finally:
        server.stop()
