"""What `statekv serve` writes to its state folder as a stream runs for long: each stream's record stays small
whatever the stream's length, and records written by earlier versions still load."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("uvicorn")
from PIL import Image  # noqa: E402

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.serve import ServeConfig, create_app  # noqa: E402
from statekv.serve.page_parts import read_text  # noqa: E402
from statekv.serve.page_watches import TIMELINE_POINTS, timeline_rows  # noqa: E402
from statekv.serve.server import AppServer  # noqa: E402

KEY = "records-key"
QUESTION = "What colour was the triangle?\nA. red\nB. green\nC. blue\nD. yellow\nAnswer with the letter."


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_options(ModelOptions(model="builtin"))


@pytest.fixture(scope="module")
def picture() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(7).integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


class Running:
    """A server in this process on a free loopback port."""

    def __init__(self, state: Path, qa):
        config = ServeConfig(options=ModelOptions(model="builtin"), state_dir=state, api_keys=(KEY,), page=False,
                             save_every_seconds=600)
        self.server = AppServer(create_app(config, qa=qa), host="127.0.0.1", port=0, log_level="warning",
                                timeout_graceful_shutdown=30)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)

    def __enter__(self) -> "Running":
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=120)
        assert not self.thread.is_alive()


def _push(client, stream_id: str, picture: bytes, start: int, stop: int) -> None:
    for k in range(start, stop):
        pushed = client.post(f"/v1/streams/{stream_id}/frames?t={k}", content=picture,
                             headers={"Content-Type": "image/png"})
        assert pushed.status_code == 200, pushed.text


def _ask_all(client, stream_id: str) -> dict:
    asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 2,
                                                              "retrieve": 100_000})
    assert asked.status_code == 200, asked.text
    return asked.json()


def _record(state: Path, stream_id: str) -> dict:
    return json.loads((state / "streams" / f"{stream_id}.json").read_text())


def test_an_answer_that_read_every_frame_of_a_long_stream_keeps_its_record_small(tmp_path, qa, picture):
    """Each answer's note in the record listed every frame it read: an answer reading the whole cache of a long
    stream made the record grow with the stream's age (rewritten at every answer). The HTTP answer still lists
    them, and a record an earlier version wrote, its notes listing the frames, still loads and reads them."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        _push(client, stream_id, picture, 0, 10)
        assert _ask_all(client, stream_id)["read_frames"] == list(range(10))
        _push(client, stream_id, picture, 10, 120)
        assert _ask_all(client, stream_id)["read_frames"] == list(range(120))
        short, long = (json.dumps(note) for note in _record(state, stream_id)["answers"])
        assert len(long) - len(short) < 40, (short, long)
    # as the previous version wrote it: the frames themselves, under read_frames
    record = _record(state, stream_id)
    for note, read in zip(record["answers"], (10, 120)):
        note.pop("read_ranges", None)
        note["read_frames"] = list(range(read))
    record["answers"].append({**record["answers"][-1], "read_frames": None})
    (state / "streams" / f"{stream_id}.json").write_text(json.dumps(record, indent=1))
    with Running(state, qa) as server, server.client() as client:
        _ask_all(client, stream_id)
        notes = _record(state, stream_id)["answers"]
        assert len(notes) == 4 and max(len(json.dumps(note)) for note in notes) < 400, notes
        assert [read_text(note) for note in notes[:3]] == [
            "read 10 frames: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9", "read 120 frames: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 …",
            "read every frame held (120)"]
        _, read, _ = timeline_rows(SimpleNamespace(answers=notes, stream=SimpleNamespace(watches=[])))
        assert 120 < TIMELINE_POINTS and [point[0] for point in read] == [*range(10), *list(range(120)) * 3]
