"""The page's file uploads met as a careless person meets them: a tab reloaded or closed while its file is still
going up, and a stream switched to another while a video added to it uploads. Each case says what happened
before."""

from __future__ import annotations

import asyncio
import json
import logging

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
