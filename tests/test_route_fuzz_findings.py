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

