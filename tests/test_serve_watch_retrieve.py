"""A watch's ``retrieve`` over HTTP (`statekv.serve.watches.watch_settings`): taken as an ask's is, so a watch on a
stream past its model's range whose own retrieve is too wide can take the retrieve its error hints at, and keep it
across a restart.

A one-layer tiny InternVL of 128 positions (as tests/test_watch_range.py): 40 frames take it about six times past
its range, under bounded positions."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")
from PIL import Image  # noqa: E402

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.testing import make_tiny_checkpoint  # noqa: E402

from test_serve_watches import Running  # noqa: E402

FRAMES = 40


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """The checkpoint's options and its VideoQA."""
    text = {"max_position_embeddings": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            "num_hidden_layers": 1}
    checkpoint = make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("short") / "ckpt", text_config=text,
                                      vision_config={"image_size": 112})
    options = ModelOptions(model=str(checkpoint), method="statekv", budget=24, reserve_tokens=24)
    return options, statekv.VideoQA.from_options(options)


@pytest.fixture(scope="module")
def pictures() -> list[bytes]:
    made = []
    for image in np.random.default_rng(0).integers(0, 256, (FRAMES + 4, 32, 32, 3), dtype=np.uint8):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        made.append(buffer.getvalue())
    return made


def _push(client, stream_id: str, pictures: list[bytes], start: int, stop: int) -> None:
    for index in range(start, stop):
        pushed = client.post(f"/v1/streams/{stream_id}/frames", content=pictures[index],
                             headers={"Content-Type": "image/png"})
        assert pushed.status_code == 200, pushed.text


def test_a_watch_takes_the_retrieve_its_error_hints_at_and_keeps_it_across_a_restart(short, pictures, tmp_path):
    """Before: a watch body refused ``retrieve`` ("unknown watch field"), so on a stream whose retrieve is too wide
    past the range every evaluation of every watch failed, the hint naming a field no watch could be given. A
    watch taking the stream's retrieve is refused with that hint now, before its frames as after them."""
    options, qa = short
    with Running(tmp_path / "state", qa, options=options) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"retrieve": 100, "max_fps": None,
                                                     "horizon_frames": None}).json()["id"]
        refusals = []
        for frames in (0, FRAMES):
            _push(client, stream_id, pictures, 0, frames)
            refused = client.post(f"/v1/streams/{stream_id}/watches", json={"question": "Why?", "every": 2,
                                                                            "max_new_tokens": 2})
            assert refused.status_code == 409, refused.text
            refusals.append(re.fullmatch(r".*; retrieve at most (\d+) frames", refused.json()["error"]["message"]))
        assert refusals[0] and refusals[1] and refusals[0][1] == refusals[1][1], refusals
        hint = refusals[1]
        made = client.post(f"/v1/streams/{stream_id}/watches", json={"question": "Why?", "every": 2,
                                                                     "max_new_tokens": 2, "retrieve": int(hint[1])})
        assert made.status_code == 201, made.text
        fitting = made.json()["id"]
        _push(client, stream_id, pictures, FRAMES, FRAMES + 2)
        watched = client.get(f"/v1/streams/{stream_id}/watches/{fitting}").json()
        assert watched["retrieve"] == int(hint[1]) and watched["error"] is None and watched["evaluations"] == 2
    with Running(tmp_path / "state", qa, options=options) as server, server.client() as client:
        _push(client, stream_id, pictures, FRAMES + 2, FRAMES + 4)
        watched = client.get(f"/v1/streams/{stream_id}/watches/{fitting}").json()
        assert watched["retrieve"] == int(hint[1]) and watched["error"] is None and watched["evaluations"] == 3


def test_a_watch_retrieve_that_is_not_one_or_not_read_gets_one_line_as_an_asks(short, pictures, tmp_path):
    options, qa = short
    with Running(tmp_path / "state", qa, options=options) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
        for retrieve in (0, -1, "3", True, 1.5, [3]):
            body = {"question": "Why?", "every": 2, "retrieve": retrieve}
            refused = client.post(f"/v1/streams/{stream_id}/watches", json=body)
            message = refused.json()["error"]["message"]
            assert refused.status_code == 400 and message.startswith("retrieve must be a positive integer"), message
            assert "\n" not in message
        unknown = client.post(f"/v1/streams/{stream_id}/watches", json={"question": "Why?", "every": 2, "k": 3})
        assert unknown.status_code == 400 and "retrieve" in unknown.json()["error"]["message"], unknown.text
        for retrieve in (None, 3):  # null: none; both shown as given
            made = client.post(f"/v1/streams/{stream_id}/watches", json={"question": "Why?", "every": 2,
                                                                         "retrieve": retrieve})
            assert made.status_code == 201, made.text
            shown = client.get(f"/v1/streams/{stream_id}/watches/{made.json()['id']}").json()
            assert shown["retrieve"] == retrieve, shown
        # a method that retrieves nothing: refused before any frame, as a question giving one is once it has one
        recent = client.post("/v1/streams", json={"method": "simplestream", "max_fps": None}).json()["id"]
        body = {"question": "Why?", "every": 2, "retrieve": 3}
        refused = client.post(f"/v1/streams/{recent}/watches", json=body)
        assert refused.status_code == 400, refused.text
        _push(client, recent, pictures, 0, 1)
        asked = client.post(f"/v1/streams/{recent}/ask", json={"question": "Why?", "retrieve": 3})
        assert asked.status_code == 400 and asked.json()["error"] == refused.json()["error"], asked.text
        assert client.post(f"/v1/streams/{recent}/watches", json=body).json()["error"] == refused.json()["error"]
        assert client.get(f"/v1/streams/{recent}/watches").json()["data"] == []


def _metric(client, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+]+)$", client.get("/metrics").text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


def test_failed_watch_evaluations_are_counted_in_the_metrics(short, pictures, tmp_path, monkeypatch):
    """Before: a watch whose evaluations failed (the model raising, here) was only logged, once as its error
    started: /metrics counted nothing an operator could alert on. Each failed evaluation is counted now, unlabelled
    as the other watch metrics are (a watch's id is no label)."""
    import statekv.api.watch as watching

    options, qa = short
    with Running(tmp_path / "state", qa, options=options) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
        _push(client, stream_id, pictures, 0, 2)
        url = f"/v1/streams/{stream_id}/watches"
        watch_id = client.post(url, json={"question": "Why?", "every": 1, "max_new_tokens": 2}).json()["id"]
        assert _metric(client, "statekv_watch_failures_total") == 0

        def out_of_memory(*args, **kwargs):
            raise RuntimeError("CUDA out of memory")

        monkeypatch.setattr(watching, "evaluate", out_of_memory)
        _push(client, stream_id, pictures, 2, 5)
        failing = client.get(f"{url}/{watch_id}").json()
        assert failing["error"] == "CUDA out of memory" and failing["evaluations"] == 1, failing
        assert _metric(client, "statekv_watch_failures_total") == 3
        assert _metric(client, "statekv_watch_evaluations_total") == 1
        monkeypatch.undo()
        _push(client, stream_id, pictures, 5, 6)
        assert client.get(f"{url}/{watch_id}").json()["error"] is None
        assert _metric(client, "statekv_watch_failures_total") == 3
        assert _metric(client, "statekv_watch_evaluations_total") == 2


def test_a_watch_too_wide_for_its_stream_past_the_range_is_refused_before_its_frames_too(short, pictures, tmp_path):
    """Before: a watch retrieving more frames than fit past the model's range was a 409 only on a stream already
    past it; made before (no frame yet, or a few) it was a 201, then failed at every evaluation past the range.
    Now each is the same one-line 409 with the hint, and the watch made with the hint is evaluated."""
    options, qa = short
    with Running(tmp_path / "state", qa, options=options) as server, server.client() as client:
        for frames in (0, 2, FRAMES):
            stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
            _push(client, stream_id, pictures, 0, frames)
            url = f"/v1/streams/{stream_id}/watches"
            refused = client.post(url, json={"question": "Why?", "every": 2, "max_new_tokens": 2, "retrieve": 30})
            assert refused.status_code == 409 and list(refused.json()) == ["error"], refused.text
            message = refused.json()["error"]["message"]
            assert "\n" not in message and message.startswith("30 retrieved frames (30 steps) of "), message
            hint = re.fullmatch(r".*; retrieve at most (\d+) frames", message)
            assert hint and client.get(url).json()["data"] == [], message
            made = client.post(url, json={"question": "Why?", "every": 2, "max_new_tokens": 2,
                                          "retrieve": int(hint[1])})
            assert made.status_code == 201, made.text
            _push(client, stream_id, pictures, frames, FRAMES + 2)
            watched = client.get(f"{url}/{made.json()['id']}").json()
            assert watched["error"] is None and watched["evaluations"] >= 1, (frames, watched)


def test_metrics_count_the_watches_failing_now(short, pictures, tmp_path):
    """Before: only ``statekv_watch_failures_total`` (every failed evaluation), whose rate cannot say how many
    watches fail now (one evaluated hourly and failing weighs little). ``statekv_watches_failing`` says it, and
    goes back to 0 once they are evaluated again."""
    from test_serve_watches import metric

    options, qa = short
    with Running(tmp_path / "state", qa, options=options) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": None, "horizon_frames": None}).json()["id"]
        made = client.post(f"/v1/streams/{stream_id}/watches", json={"question": "Why?", "every": 2,
                                                                     "max_new_tokens": 2, "retrieve": 1})
        assert made.status_code == 201, made.text
        assert metric(client, "statekv_watches_failing") == 0
        watch, = server.app.state.service.registry.entries[stream_id].stream.watches
        watch.retrieve = 100  # as a watch opened before the check that its retrieve fits past the range
        _push(client, stream_id, pictures, 0, FRAMES)
        assert client.get(f"/v1/streams/{stream_id}/watches/{watch.id}").json()["error"] is not None
        assert metric(client, "statekv_watches_failing") == 1 and metric(client, "statekv_watch_failures_total") > 1
        watch.retrieve = 1
        _push(client, stream_id, pictures, FRAMES, FRAMES + 2)
        assert metric(client, "statekv_watches_failing") == 0
