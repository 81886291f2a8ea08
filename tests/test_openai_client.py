"""The OpenAI-compatible routes driven as the official ``openai`` client drives them: its requests reproduced over
HTTP (the paths, bodies and headers it sends) against a server built in this process from the built-in model with
a small reserve for questions and answers, a short video under its media root. Each case says what the route did
before."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.serve import ServeConfig, create_app  # noqa: E402
from statekv.testing.videos import write_test_video  # noqa: E402

KEY = "openai-client-key"
RESERVE = 48  # tokens kept after a video for its question and answer
QUESTION = "What is shown?"


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_options(ModelOptions(model="builtin", budget=64, reserve_tokens=RESERVE))


@pytest.fixture(scope="module")
def served(qa, tmp_path_factory):
    """A client of a server of ``qa`` (with the ``openai`` client's headers) and a video's ``file://`` URL."""
    media = tmp_path_factory.mktemp("media")
    video = write_test_video(media / "clip.mp4", frames=8, fps=4)
    config = ServeConfig(options=qa.options, state_dir=tmp_path_factory.mktemp("state") / "state", api_keys=(KEY,),
                         media_root=media, page=False, save_every_seconds=600)
    headers = {"Authorization": f"Bearer {KEY}", "User-Agent": "OpenAI/Python", "X-Stainless-Lang": "python"}
    with TestClient(create_app(config, qa=qa), headers=headers) as client:
        yield client, video.as_uri()


def _message(response, status: int) -> str:
    assert response.status_code == status, (response.status_code, response.text[:300])
    message = response.json()["error"]["message"]
    assert "\n" not in message, message
    return message


def test_a_model_is_retrieved_by_its_id(served):
    """``client.models.retrieve("builtin")`` (``GET /v1/models/builtin``) was a 404 "no route": only the list
    was served."""
    client, _ = served
    listed = client.get("/v1/models").json()["data"][0]
    assert client.get(f"/v1/models/{listed['id']}").json() == listed
    message = _message(client.get("/v1/models/gpt-4o"), 404)
    assert '"gpt-4o"' in message and f'"{listed["id"]}"' in message, message
    assert "is not served" in _message(client.get("/v1/models/org%2Fname"), 404)  # the client escapes a slash
    assert _message(client.get(f"/v1/models/{listed['id']}", headers={"Authorization": "Bearer wrong"}), 401)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_chat_over_a_file_has_room_for_the_answer_length_it_asks(served, streamed):
    """A file is encoded by the server for its chat, with room after it for the question and answer; that room was
    the server's reserve whatever ``max_tokens`` asked, so an answer longer than the reserve less the question (any
    ``max_tokens`` near 1024, the most allowed, under the default reserve of 1024) was a 413 telling the client to
    ask a shorter question, after the whole file was encoded."""
    client, url = served
    body = {"model": "builtin", "max_tokens": RESERVE, "stream": streamed, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": QUESTION}]}]}
    answered = client.post("/v1/chat/completions", json=body)
    assert answered.status_code == 200, answered.text[:300]
    usage = answered.json()["usage"] if not streamed else \
        json.loads(answered.text.split("data: [DONE]")[0].strip().splitlines()[-1][len("data: "):])["usage"]
    assert 1 <= usage["completion_tokens"] <= RESERVE, usage
