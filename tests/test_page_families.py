"""The page over a Qwen3-VL stream (tiny checkpoint), whose frames are encoded in pairs: a frame pushed may wait for
its partner, and a frame may be dropped by max_fps. Each case says what the page showed before."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")
from PIL import Image  # noqa: E402

from statekv.serve.page_parts import lost_text  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen_server(tiny_checkpoint, tmp_path_factory):
    from test_serve import Server

    folder = tmp_path_factory.mktemp("qwen-page")
    (folder / "media").mkdir()
    running = Server(folder / "state", folder / "media", "--model", str(tiny_checkpoint("qwen3_vl")), "--budget", "64",
                     "--offload", "disk", "--offload-dir", str(folder / "tier"), "--save-every-frames", "2").start()
    yield running
    running.stop()


@pytest.fixture
def chromium():
    from test_serve import chromium_browser

    with chromium_browser() as browser:
        yield browser


def _push(client, stream_id: str, t: float) -> dict:
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(int(t * 10)).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(png, "PNG")
    pushed = client.post(f"/v1/streams/{stream_id}/frames?t={t}", content=png.getvalue(),
                         headers={"Content-Type": "image/png"})
    assert pushed.status_code == 200, pushed.text
    return pushed.json()


def _open(browser, server, stream_id: str):
    from test_serve import KEY

    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    page.goto(f"{server.url}/?key={KEY}&stream={stream_id}")
    page.wait_for_selector(".statekv-stats:has-text('frames')", timeout=60_000)
    return page


def _text_becomes(page, selector: str, expected: str) -> str:
    """The text of ``selector`` once it is ``expected`` (the page refreshes every half second), else as it is."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and page.inner_text(selector) != expected:
        time.sleep(0.2)
    return page.inner_text(selector)


def test_the_frame_shown_is_named_by_its_place_and_time_and_after_a_kill_the_page_says_what_was_lost(qwen_server,
                                                                                                      chromium):
    """Three frames pushed at 0, 1 and 2 s: the third waits for its partner. Before: the page said "2 frames" only
    (the API: pending 1) and captioned the third frame "frame 2 at 2.0 s" (the frames encoded, with the time of the
    last push, even a dropped one), and after a kill it still showed the record's last frame, one the stream came
    back without, and said nothing of what was lost (the API's ``lost``); once it said so, it went on naming the
    index to push again from at the start after the frames were pushed again from there."""
    with qwen_server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1.0}).json()["id"]
        for t in (0.0, 1.0, 2.0):
            _push(client, stream_id, t)
        page = _open(chromium, qwen_server, stream_id)
        assert not page.is_visible(".statekv-lost")
        assert _text_becomes(page, ".statekv-frame-caption", "frame 3 at 2.0 s, waiting to be encoded") == \
            "frame 3 at 2.0 s, waiting to be encoded"
        assert page.inner_text(".statekv-stats").startswith("2 frames (and 1 waiting to be encoded) · ")
        assert _push(client, stream_id, 2.5)["kept"] is False  # dropped by max_fps: the frame shown stays
        time.sleep(1.5)
        assert page.inner_text(".statekv-frame-caption") == "frame 3 at 2.0 s, waiting to be encoded"
        _push(client, stream_id, 3.0)
        assert _text_becomes(page, ".statekv-frame-caption", "frame 4 at 3.0 s") == "frame 4 at 3.0 s"
        _push(client, stream_id, 4.0)  # its 6th push, kept 5th, waits; the last save was before the 5th push
        asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": "What?", "max_new_tokens": 2})
        assert asked.status_code == 200, asked.text  # the record now names the fifth frame as the last one
        page.close()
    qwen_server.kill()
    qwen_server.start()
    with qwen_server.client() as client:
        info = client.get(f"/v1/streams/{stream_id}").json()
    assert info["lost"] and info["pushed"] < 6, info
    page = _open(chromium, qwen_server, stream_id)
    assert page.inner_text(".statekv-frame-caption") == f"{info['frames']} frames held; the next one pushed shows here"
    said = lost_text(info["lost"], info)
    assert f"index {info['resume_from']}, after {info['resume_after_seconds']:.1f} s." in said, said
    assert page.inner_text(".statekv-lost") == said  # before: the page said nothing of it
    assert page.evaluate("() => [...document.querySelectorAll('.statekv-frame img')].map(i => i.src)"
                         ".filter(src => src.startsWith('data:')).length") == 0
    with qwen_server.client() as client:  # pushed again from resume_from: the line says where to push next now
        for t in (info["resume_after_seconds"] + 1.0, info["resume_after_seconds"] + 2.0):
            _push(client, stream_id, t)
        again = client.get(f"/v1/streams/{stream_id}").json()
    assert again["resume_from"] == info["resume_from"] + 2, again
    expected = lost_text(info["lost"], again)
    assert f"index {again['resume_from']}, after {again['resume_after_seconds']:.1f} s." in expected, expected
    assert _text_becomes(page, ".statekv-lost", expected) == expected  # before: still the index of the start
