"""The page's file uploads and inputs met as a careless person meets them: a tab reloaded or closed while its file is
still going up, a stream switched to another while a video added to it uploads, two tabs adding a video to one stream
at once, a pasted half character, a paste of megabytes, an address mangled. Each case says what happened before."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")
from fastapi import Request  # noqa: E402

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.serve import ServeConfig, create_app  # noqa: E402

KEY = "page-uploads-key"


def test_a_body_cut_off_by_its_client_is_a_499_never_an_internal_error(tmp_path, caplog):
    """Before: the page's uploader (NiceGUI's route, which reads its form itself) met a tab reloaded mid-upload
    with ``ClientDisconnect``: answered and counted as a 500, logged "internal error" with its whole traceback."""
    qa = statekv.VideoQA.from_options(ModelOptions(model="builtin", budget=64))
    config = ServeConfig(options=qa.options, state_dir=tmp_path / "state", api_keys=(KEY,), page=False,
                         save_every_seconds=600)
    app = create_app(config, qa=qa)

    async def reads_a_form(request: Request) -> dict:
        async with request.form():
            return {}

    app.add_api_route("/a-form", reads_a_form, methods=["POST"])
    received = [{"type": "http.request", "body": b"--x\r\nContent-Disposition: form-data; name=\"f\"; "
                 b"filename=\"v.mp4\"\r\n\r\nhalf", "more_body": True}, {"type": "http.disconnect"}]
    sent = []

    async def receive() -> dict:
        return received.pop(0) if received else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/a-form", "raw_path": b"/a-form", "root_path": "", "query_string": b"",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5000),
             "headers": [(b"content-type", b"multipart/form-data; boundary=x"), (b"content-length", b"100000")]}
    with caplog.at_level(logging.INFO, logger="statekv.serve"):
        asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499, sent
    body = json.loads(b"".join(message.get("body", b"") for message in sent[1:]))
    assert "went away" in body["error"]["message"], body
    assert not [record for record in caplog.records if record.exc_info or "internal error" in record.getMessage()]


# A server on which two files named together*.mp4 are opened as one: each waits, once open, for the other, so the
# checks of two tabs' uploads run in one turn of the server's loop, as two arriving together may.
TOGETHER = """
import asyncio, sys
from statekv.cli import main
from statekv.serve.feeding import FileFeeds

opened, waiting = FileFeeds.open_source, []

async def open_together(self, path, shown):
    video = await opened(self, path, shown)
    if shown.startswith("together"):
        arrived = asyncio.Event()
        waiting.append(arrived)
        if len(waiting) == 2:
            for each in waiting:
                each.set()
            waiting.clear()
        await asyncio.wait_for(arrived.wait(), 120)
    return video

FileFeeds.open_source = open_together
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def uploads_server(tmp_path_factory):
    from test_serve import Server

    from statekv.testing.videos import write_test_video

    media = tmp_path_factory.mktemp("media")
    write_test_video(media / "clip.mp4", frames=4, fps=1)
    write_test_video(media / "added.mp4", frames=12, fps=1, size=(320, 240))  # big enough to take a while up
    write_test_video(media / "together.mp4", frames=6, fps=1)
    running = Server(tmp_path_factory.mktemp("uploads") / "state", media, launch=("-c", TOGETHER)).start()
    yield running
    running.stop()


@pytest.mark.slow
def test_a_video_added_to_a_stream_goes_into_it_though_another_is_opened_as_it_uploads(uploads_server):
    """Before: the file went into the stream open once it was up, not the one it was added to (the other stream
    took its frames, and its own stream none)."""
    from test_serve import KEY, chromium_browser

    server = uploads_server
    with server.client() as client:
        def made() -> str:
            stream_id = client.post("/v1/streams").json()["id"]
            client.post(f"/v1/streams/{stream_id}/frames", json={"source": "clip.mp4"}).raise_for_status()
            return stream_id

        added_to, other = made(), made()
        frames = lambda stream_id: client.get(f"/v1/streams/{stream_id}").json()["frames"]  # noqa: E731
        with chromium_browser() as browser:
            page = browser.new_page()
            page.goto(f"{server.url}/?key={KEY}&stream={added_to}")
            page.wait_for_selector(".statekv-stats:has-text('4 frames ·')", timeout=60_000)
            network = page.context.new_cdp_session(page)
            network.send("Network.enable")
            network.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0,
                                                              "downloadThroughput": -1, "uploadThroughput": 2000})
            page.set_input_files(".statekv-upload-more input[type=file]", str(server.media / "added.mp4"))
            page.wait_for_function("() => /[1-9]/.test((document.querySelector('.statekv-upload-more "
                                   ".q-uploader__subtitle') || {}).innerText || '')", timeout=30_000)
            page.locator(f".statekv-stream-{other}").get_by_role("button", name="open").click()
            page.wait_for_function(f"() => location.href.includes({other!r})", timeout=30_000)
            network.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0,
                                                              "downloadThroughput": -1, "uploadThroughput": -1})
            deadline = time.monotonic() + 60
            while frames(added_to) < 16 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert (frames(added_to), frames(other)) == (16, 4)
            assert page.inner_text(".statekv-title") and page.url.endswith(other)  # the view stays where it went


def _stream_of(server, client, video: str = "clip.mp4") -> str:
    stream_id = client.post("/v1/streams").json()["id"]
    client.post(f"/v1/streams/{stream_id}/frames", json={"source": video}).raise_for_status()
    return stream_id


def _tab_on(browser, server, stream_id: str, frames: int):
    from test_serve import KEY

    tab = browser.new_context().new_page()
    tab.goto(f"{server.url}/?key={KEY}&stream={stream_id}")
    tab.wait_for_selector(f".statekv-stats:has-text('{frames} frames ·')", timeout=60_000)
    return tab


@pytest.mark.slow
def test_of_two_tabs_adding_a_video_to_one_stream_at_once_the_second_is_told_why_not(uploads_server):
    """Before: both tabs' checks passed, the second's feed was refused as it began, and that tab was told nothing
    (its file was gone, its stream unchanged, the refusal logged alone)."""
    from test_serve import chromium_browser

    server = uploads_server
    with server.client() as client, chromium_browser() as browser:
        stream_id = _stream_of(server, client)
        tabs = [_tab_on(browser, server, stream_id, 4) for _ in range(2)]
        for tab in tabs:
            tab.set_input_files(".statekv-upload-more input[type=file]", str(server.media / "together.mp4"))
        for tab in tabs:
            tab.wait_for_selector(".statekv-stats:has-text('10 frames ·')", timeout=60_000)
        notes = []
        for tab in tabs:
            tab.wait_for_timeout(1000)  # (a refresh's worth)
            note = tab.locator(".statekv-error-more:visible .statekv-error-message")
            notes += [note.inner_text()] if note.count() else []
        assert notes == ["this stream is being fed together.mp4; wait until it is done, or stop it"], notes
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 10  # one file whole, the other not at all
    assert "Traceback" not in server.printed()


@pytest.mark.slow
def test_a_question_holding_half_a_character_is_asked_with_it_replaced(uploads_server):
    """Before: a lone surrogate pasted into the question (half of a UTF-16 pair, as some clipboards hold) made
    NiceGUI refuse the whole event with a traceback in the server's log, and the page read the question as empty."""
    from test_serve import chromium_browser

    server = uploads_server
    with server.client() as client, chromium_browser() as browser:
        tab = _tab_on(browser, server, _stream_of(server, client), 4)
        tab.get_by_label("Question").evaluate("box => { box.value = 'Which colour \\ud800 was it?'; "
                                              "box.dispatchEvent(new Event('input', {bubbles: true})); }")
        tab.get_by_role("button", name="Ask").click()
        tab.wait_for_selector(".statekv-answer", timeout=60_000)
        assert "Which colour \ufffd was it?" in tab.inner_text(".statekv-answer-question")
        assert not tab.locator(".statekv-error-ask:visible").count()
    assert "Traceback" not in server.printed()


@pytest.mark.slow
def test_a_long_stream_in_the_address_is_named_short(uploads_server):
    """Before: a ``?stream=`` of 20,000 characters (a pasted log line, a mangled link) was repeated whole in the
    page's note."""
    from test_serve import KEY, chromium_browser

    with chromium_browser() as browser:
        tab = browser.new_page()
        tab.goto(f"{uploads_server.url}/?key={KEY}&stream={'x' * 20_000}")
        tab.wait_for_selector(".statekv-status:has-text('you had open')", timeout=60_000)
        note = tab.inner_text(".statekv-status")
        assert "(20,000 characters)" in note and len(note) < 200, note[:300]


@pytest.mark.slow
def test_a_question_pasted_over_a_megabyte_long_is_refused_not_swapped_for_the_last_one(uploads_server):
    """Before: NiceGUI never sends a value of 1 MB or more, so the page asked the question typed before the paste (or
    read the question as empty), while the box showed the pasted one."""
    from test_serve import chromium_browser

    server = uploads_server
    with server.client() as client, chromium_browser() as browser:
        tab = _tab_on(browser, server, _stream_of(server, client), 4)
        question = tab.get_by_label("Question")
        question.fill("Which colour was it?")
        tab.wait_for_timeout(500)  # (sent)
        question.fill("q" * 1_100_000)
        tab.get_by_role("button", name="Ask").click()
        tab.wait_for_selector(".statekv-answer, .statekv-error-ask:visible", timeout=60_000)
        assert "over the limit of 8000" in tab.inner_text(".statekv-error-ask .statekv-error-message")
        assert not tab.locator(".statekv-answer").count()
