"""What a fuzzer of every `statekv serve` route found: requests malformed in ways a careful client never sends, each
answered with a one-line 4xx, never a 500, and never taken otherwise than it asked.

Each server runs in this process (`test_hostile_service.Running`, the built-in model). Each case says what the
service did before.
"""

from __future__ import annotations

import pytest

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")

from statekv.serve.limits import MAX_JSON_DEPTH  # noqa: E402
from statekv.testing import write_test_video  # noqa: E402

from test_hostile_service import Running, _error, _stream  # noqa: E402
from test_hostile_service import options, qa  # noqa: E402,F401 -- the module's fixtures


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_a_body_nested_near_the_parsers_limit_is_a_one_line_400(qa, tmp_path):
    """Before: a body the JSON parser just took (a setting nested some 950 arrays deep, under Python 3.11) left the
    check that names a bad value no room to write it: a 500 RecursionError, its traceback in the server's log."""
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        for depth in range(850, 1000):  # where the parser's limit falls depends on the stack the route runs on
            reply = client.post("/v1/streams", content='{"budget": %s}' % _nested(depth),
                                headers={"Content-Type": "application/json"})
            assert _error(reply, 400), depth
        within = client.post("/v1/streams", content='{"budget": %s}' % _nested(MAX_JSON_DEPTH - 1),
                             headers={"Content-Type": "application/json"})
        assert "budget must be" in _error(within, 400)  # the body's object is one level: refused for its value
        beyond = client.post("/v1/streams", content='{"budget": %s}' % _nested(MAX_JSON_DEPTH),
                             headers={"Content-Type": "application/json"})
        assert f"more than {MAX_JSON_DEPTH} levels" in _error(beyond, 400)
        assert client.get("/v1/streams").json()["data"] == []  # nothing made


def test_a_json_feed_given_t_as_a_query_parameter_is_refused_not_placed_elsewhere(qa, tmp_path):
    """``?t=`` is an image's time. Before: a JSON feed given ``?t=100`` was fed from the stream's own next time
    (0 s), the parameter silently ignored, its frames placed otherwise than asked."""
    media = tmp_path / "media"
    media.mkdir()
    write_test_video(media / "clip.mp4", frames=60, fps=30.0)
    with Running(tmp_path / "state", qa, media_root=media) as server, server.client() as client:
        stream_id = _stream(client, frames=0)
        reply = client.post(f"/v1/streams/{stream_id}/frames?t=100", json={"source": "clip.mp4"})
        message = _error(reply, 400)
        assert '"t"' in message and "query" in message, message
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 0  # nothing fed
        fed = client.post(f"/v1/streams/{stream_id}/frames", json={"source": "clip.mp4", "t": 100})
        assert fed.status_code == 200, fed.text
        assert fed.json()["seconds"] == 101.0  # two frames at 1 fps, from 100 s
