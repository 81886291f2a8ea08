"""The OpenAI-compatible chat route and /metrics under hostile but plausible requests.

The server is built in this process (the built-in model, FastAPI's TestClient); streams of three random frames are
asked through ``"statekv": {"stream_id": ID}``, alone or, where questions are answered together, two at once. Each
case says what the route did before.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")
import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

import statekv  # noqa: E402
import statekv.api.asking as asking  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.serve import ServeConfig, create_app  # noqa: E402

from conftest import png_bytes, random_frames  # noqa: E402

KEY = "hostile-openai-key"
QUESTION = "What colour was the triangle?"  # answered at length by the built-in model


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_options(ModelOptions(model="builtin", budget=64))


@pytest.fixture(scope="module")
def server(qa, tmp_path_factory):
    """A client of a server of ``qa`` and the ids of two streams of three random frames each."""
    config = ServeConfig(options=qa.options, state_dir=tmp_path_factory.mktemp("openai") / "state", api_keys=(KEY,),
                         page=False, save_every_seconds=600)
    with TestClient(create_app(config, qa=qa), headers={"Authorization": f"Bearer {KEY}"}) as client:
        ids = []
        for seed in (7, 8):
            stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
            for frame in random_frames(3, seed=seed):
                pushed = client.post(f"/v1/streams/{stream_id}/frames", content=png_bytes(frame),
                                     headers={"Content-Type": "image/png"})
                assert pushed.status_code == 200, pushed.text
            ids.append(stream_id)
        yield client, ids


@pytest.fixture(scope="module")
def served(server):
    client, ids = server
    return client, ids[0]


def _body(stream_id: str, **fields) -> dict:
    return {"model": "builtin", "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}],
            "statekv": {"stream_id": stream_id}, **fields}


def _chunks(text: str) -> list:
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _one_line_400(response, field: str) -> None:
    assert response.status_code == 400, (response.status_code, response.text[:300])
    message = response.json()["error"]["message"]
    assert field in message and "\n" not in message, message


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_model_that_is_not_finite_json_is_a_400_not_a_500(served, literal):
    """Before: Python's json reads NaN/Infinity; the answer was generated, then rendering the response (which echoes
    ``model``) raised ValueError: a 500 for a user's error, the answer's work lost."""
    client, stream_id = served
    text = json.dumps(_body(stream_id, model=None)).replace('"model": null', f'"model": {literal}')
    response = client.post("/v1/chat/completions", content=text, headers={"Content-Type": "application/json"})
    _one_line_400(response, "model")


@pytest.mark.parametrize("model", [5, {"a": 1}, ["builtin"], True])
def test_a_model_that_is_not_text_is_refused(served, model):
    """Before: echoed as given, so the completion's ``model`` was a number or an object (OpenAI's is a string)."""
    client, stream_id = served
    _one_line_400(client.post("/v1/chat/completions", json=_body(stream_id, model=model)), "model")


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_not_served_here_is_a_404_naming_the_one_that_is(served, stream):
    """Before: any name was echoed as the completion's ``model``, so a client that meant another model took this
    one's answers for its own; OpenAI's API and vllm serve answer 404. The served id, or none, is answered."""
    client, stream_id = served
    refused = client.post("/v1/chat/completions", json=_body(stream_id, model="gpt-4o", stream=stream))
    assert refused.status_code == 404, (refused.status_code, refused.text[:300])
    message = refused.json()["error"]["message"]
    assert '"gpt-4o"' in message and '"builtin"' in message and "/v1/models" in message and "\n" not in message
    served_id = client.get("/v1/models").json()["data"][0]["id"]
    for named in (served_id, None):
        answered = client.post("/v1/chat/completions", json=_body(stream_id, model=named))
        assert answered.status_code == 200 and answered.json()["model"] == served_id, answered.text[:300]


def test_a_streamed_answer_never_sends_invalid_json(served):
    """Before: ``"model": NaN`` was echoed into every chunk as the bare word NaN, which no JSON parser reads."""
    client, stream_id = served
    text = json.dumps(_body(stream_id, stream=True, model=None)).replace('"model": null', '"model": NaN')
    response = client.post("/v1/chat/completions", content=text, headers={"Content-Type": "application/json"})
    if response.status_code == 200:
        _chunks(response.text)  # every chunk parses as strict JSON
        assert "NaN" not in response.text
    else:
        _one_line_400(response, "model")


def test_a_huge_model_name_is_not_echoed_into_every_chunk(served):
    """Before: a 200 kB ``model`` was echoed into each of the answer's chunks: a 200 kB request for a 200-token
    answer came back as about 40 MB (a 16 MB body and 1024 tokens: about 16 GB)."""
    client, stream_id = served
    body = _body(stream_id, stream=True, max_tokens=200, model="m" * 200_000)
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 or len(response.content) < 2 * len(json.dumps(body)), len(response.content)


@pytest.mark.parametrize("after", [
    {"role": "assistant", "content": "The triangle was"},  # an assistant prefix to continue
    {"role": "tool", "content": "red", "tool_call_id": "call_1"},  # a tool's result
])
def test_messages_after_the_last_user_message_are_reported_as_not_read(served, after):
    """Before: ``not_read`` counted only the messages before the last user message; one after it was left out of
    the answer and of ``not_read`` alike, so the response claimed nothing was left out."""
    client, stream_id = served
    body = _body(stream_id, messages=[{"role": "user", "content": QUESTION}, after])
    response = client.post("/v1/chat/completions", json=body)
    if response.status_code == 400:
        return  # refused clearly is as good
    assert response.status_code == 200, response.text
    assert response.json()["statekv"].get("not_read"), response.json()["statekv"]


@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]),
    ("functions", [{"name": "f", "parameters": {"type": "object", "properties": {}}}]),
    ("functions-forced", [{"name": "f", "parameters": {"type": "object", "properties": {}}}]),
    ("modalities", ["text", "audio"]),
])
def test_fields_that_change_the_answers_meaning_are_refused_or_reported(served, field, value):
    """Before: answered 200 as if the field were absent, named nowhere (not even in ``statekv.not_applied``): a
    client asking for JSON, a tool call or audio got free text and no sign of it."""
    client, stream_id = served
    extra = {"tool_choice": "required"} if field == "tools" else {"audio": {"voice": "alloy", "format": "wav"}} \
        if field == "modalities" else {"function_call": {"name": "f"}} if field == "functions-forced" else {}
    field = field.split("-")[0]
    response = client.post("/v1/chat/completions", json=_body(stream_id, **{field: value}, **extra))
    if response.status_code == 200:
        assert field in response.json()["statekv"].get("not_applied", []), response.json()["statekv"]
    else:
        _one_line_400(response, field)


@pytest.mark.parametrize("field,value", [
    ("temperature", "hot"), ("temperature", -1), ("temperature", 99), ("temperature", 10**400), ("top_p", 2),
    ("stop", 5), ("top_logprobs", 1.5),
    ("seed", "x"), ("logprobs", "yes"), ("presence_penalty", "a lot"),
])
def test_malformed_sampling_values_are_a_400(served, field, value):
    """Before: any value at all was taken (200, at most named in ``not_applied``); OpenAI answers these 400."""
    client, stream_id = served
    _one_line_400(client.post("/v1/chat/completions", json=_body(stream_id, **{field: value})), field)


def _errors_total(client) -> float:
    text = client.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("statekv_errors_total"))


def test_a_streamed_chat_that_fails_is_counted_as_an_error(served):
    """Before: a streamed completion that failed once its chunks had begun (here: a question too long for the
    model's range, 413 in an error chunk) was counted nowhere in /metrics: not in ``statekv_errors_total``, not as
    an ask."""
    client, stream_id = served
    before = _errors_total(client)
    body = _body(stream_id, stream=True, messages=[{"role": "user", "content": "what " * 1599}])
    response = client.post("/v1/chat/completions", json=body)
    failed = response.status_code != 200 or any("error" in chunk for chunk in _chunks(response.text))
    assert failed, response.text[:300]
    assert _errors_total(client) == before + 1


def test_errors_are_counted_by_the_route_they_took_never_by_a_path_or_method_a_client_made_up(served):
    """Before: ``statekv_errors_total`` had the status alone, so an operator could not tell a camera's refused
    pushes from a client's bad questions. A stream's id or a made-up method would grow the labels without bound."""
    client, stream_id = served
    for missing in ("st_gone1", "st_gone2"):
        assert client.post(f"/v1/streams/{missing}/frames", content=b"x").status_code == 404
    assert client.post("/v1/chat/completions", json=_body(stream_id, model="gpt-4o")).status_code == 404
    assert client.get("/v1/nowhere/st_gone3").status_code == 404
    assert client.request("BREW", "/v1/streams").status_code == 405
    counts = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
              if line.startswith("statekv_errors_total{")}
    assert counts['statekv_errors_total{route="POST /v1/streams/{stream_id}/frames",status="404"}'] >= 2, counts
    assert counts['statekv_errors_total{route="POST /v1/chat/completions",status="404"}'] >= 1, counts
    assert counts['statekv_errors_total{route="unmatched",status="404"}'] >= 1, counts
    assert counts['statekv_errors_total{route="unmatched",status="405"}'] >= 1, counts
    assert not [label for label in counts if "st_gone" in label or "BREW" in label], counts


def test_deleting_a_stream_stops_its_answer_under_way_at_once(server, qa):
    """Before: a DELETE waited for an answer being generated from the stream, and the answer ran on to its
    ``max_tokens`` (minutes for 1,024 tokens on a busy machine), holding the model from every other stream. Now the
    answer stops at its next token and ends with a 404 saying why, streamed or not, and the DELETE answers at once."""
    client, _ = server

    def stream_of_three_frames() -> str:
        stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
        for frame in random_frames(3, seed=9):
            client.post(f"/v1/streams/{stream_id}/frames", content=png_bytes(frame),
                        headers={"Content-Type": "image/png"}).raise_for_status()
        return stream_id

    streamed_id, whole_id = stream_of_three_frames(), stream_of_three_frames()
    begun, lines = threading.Event(), []

    def ask_streamed() -> None:
        with client.stream("POST", "/v1/chat/completions",
                           json=_body(streamed_id, max_tokens=1024, stream=True)) as response:
            for line in response.iter_lines():
                lines.append(line)
                if '"content": "' in line and '"content": ""' not in line:
                    begun.set()
        begun.set()

    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(ask_streamed)
        assert begun.wait(120)
        assert client.delete(f"/v1/streams/{streamed_id}").status_code == 200
        streamed.result(timeout=120)
        generating = threading.Event()  # the answer not streamed has begun: its tokens go through the output head
        hook = qa.adapter.model.get_output_embeddings().register_forward_hook(lambda *args: generating.set())
        try:
            whole = pool.submit(client.post, "/v1/chat/completions", json=_body(whole_id, max_tokens=1024))
            assert generating.wait(120)
            asked = time.monotonic()
            assert client.delete(f"/v1/streams/{whole_id}").status_code == 200
            deleting = time.monotonic() - asked  # (1,024 tokens take minutes on a loaded 2-core machine)
            reply = whole.result(timeout=120)
        finally:
            hook.remove()
    data = [line for line in lines if line.startswith("data: ")]
    failure = json.loads(data[-1][len("data: "):])
    tokens = sum(1 for line in data if '"content": "' in line) - 1
    assert failure["error"]["code"] == 404 and tokens < 1024, (lines[-3:], tokens)
    assert f"stream {streamed_id} was deleted while answering" in failure["error"]["message"]
    stopped = re.fullmatch(f"stream {whole_id} was deleted while answering; the answer was stopped after (\\d+) tokens",
                           reply.json()["error"]["message"])
    assert reply.status_code == 404 and stopped and int(stopped.group(1)) < 1024 and deleting < 30, reply.text


def test_the_streamed_deltas_add_up_to_the_answer_not_streamed(served):
    """Before: the deltas began with the first token's leading space (" square square ...") while the answer not
    streamed was stripped ("square square ..."): the same request gave two texts."""
    client, stream_id = served
    whole = client.post("/v1/chat/completions", json=_body(stream_id, max_tokens=6))
    assert whole.status_code == 200, whole.text
    streamed = client.post("/v1/chat/completions", json=_body(stream_id, max_tokens=6, stream=True))
    assert streamed.status_code == 200, streamed.text
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in _chunks(streamed.text)
                   if chunk.get("choices"))
    assert text == whole.json()["choices"][0]["message"]["content"]


def _completion(client, stream_id: str, streamed: bool, **fields) -> tuple[str, str, dict]:
    """The answer's text, its finish_reason and its ``statekv`` object, streamed or not."""
    response = client.post("/v1/chat/completions", json=_body(stream_id, stream=streamed, **fields))
    assert response.status_code == 200, response.text[:300]
    if not streamed:
        choice = response.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"], response.json()
    chunks = [chunk for chunk in _chunks(response.text) if chunk.get("choices")]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    return text, chunks[-1]["choices"][0]["finish_reason"], chunks[-1]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("stop", [" red", ["nothing like it", "e r"], "red red"],
                         ids=["a word", "across two tokens", "after a space"])
def test_a_stop_sequence_ends_the_answer_before_it(served, streamed, stop):
    """Before: ``stop`` was not applied (named in ``not_applied``): the answer ran on past it to ``max_tokens``.
    Now the answer ends before the first stop sequence, which it does not hold (streamed, no piece of it is sent,
    though the text that could begin one came a token earlier), its generation stops there, and its finish_reason
    is ``stop``; the text before it is kept as it is, a space before the stop too (the answer not streamed lost it,
    so the two differed)."""
    client, stream_id = served
    whole, finish, _ = _completion(client, stream_id, False, max_tokens=12)
    assert finish == "length" and whole.startswith("square red red"), whole  # the built-in model's answer
    text, finish, reply = _completion(client, stream_id, streamed, max_tokens=12, stop=stop,
                                      stream_options={"include_usage": True} if streamed else None)
    cut = min(index for index in (whole.find(s) for s in ([stop] if isinstance(stop, str) else stop)) if index >= 0)
    assert (text, finish) == (whole[:cut], "stop")
    assert "stop" not in reply["statekv"].get("not_applied", [])
    if not streamed:
        assert reply["usage"]["completion_tokens"] < 12  # the generation stopped at the stop sequence


def test_a_stop_sequence_never_met_changes_nothing_and_a_long_one_is_a_400(served):
    client, stream_id = served
    whole = _completion(client, stream_id, False, max_tokens=6)
    assert _completion(client, stream_id, False, max_tokens=6, stop=["blue", "\n"])[:2] == whole[:2]
    assert _completion(client, stream_id, True, max_tokens=6, stop="blue")[:2] == whole[:2]
    _one_line_400(client.post("/v1/chat/completions", json=_body(stream_id, stop="x" * 257)), "stop")


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_an_answer_ending_on_its_last_allowed_token_finished_by_stopping(served, streamed):
    """Before: finish_reason was ``length`` whenever the answer took all of ``max_tokens``, even where its last
    token was the model's end token: the answer was whole, not cut."""
    client, stream_id = served
    question = [{"role": "user", "content": "How many frames?"}]  # the built-in model answers "A" and ends
    text, finish, reply = _completion(client, stream_id, False, max_tokens=64, messages=question)
    used = reply["usage"]["completion_tokens"]
    assert (finish, used) == ("stop", 2), (text, finish, used)
    assert _completion(client, stream_id, streamed, max_tokens=used, messages=question)[:2] == (text, "stop")
    assert _completion(client, stream_id, streamed, max_tokens=used - 1, messages=question)[1] == "length"


def test_a_stop_sequence_stops_the_generation_at_the_token_that_meets_it_on_every_path(served):
    """Before: where ``generate`` answered (a simplestream stream, whose questions read its last frames afresh),
    its criteria were asked before its streamer saw the token that met the stop, so one token more was generated
    and counted in ``usage`` than where questions are answered together."""
    client, stream_id = served
    recent = client.post("/v1/streams", json={"method": "simplestream", "max_fps": None}).json()["id"]
    for frame in random_frames(3, seed=7):
        client.post(f"/v1/streams/{recent}/frames", content=png_bytes(frame),
                    headers={"Content-Type": "image/png"}).raise_for_status()
    for stop in (" red", "red red"):
        used = []
        for target in (stream_id, recent):
            response = client.post("/v1/chat/completions", json=_body(target, max_tokens=12, stop=stop))
            whole = response.json()
            assert whole["choices"][0]["finish_reason"] == "stop", whole
            text = client.post("/v1/chat/completions", json=_body(target, max_tokens=12)).json()
            assert whole["choices"][0]["message"]["content"] == text["choices"][0]["message"]["content"][
                :text["choices"][0]["message"]["content"].find(stop)]  # as it stands, a space before it too
            used.append(whole["usage"]["completion_tokens"])
        assert used[0] == used[1], (stop, used)


def _answer(client, stream_id: str, streamed: bool, **fields) -> tuple[str, str]:
    """The answer's text and its finish_reason (at most 12 tokens unless ``fields`` say otherwise)."""
    return _completion(client, stream_id, streamed, **{"max_tokens": 12, **fields})[:2]


@pytest.mark.parametrize("stop", ["B: ", "A: "])
def test_a_stop_sequence_ending_in_whitespace_is_left_out_of_an_answer_not_streamed(server, qa, stop):
    """Before: the answer not streamed was cut from its text stripped of whitespace, where a stop sequence met on
    its last token (ending in a space) was no longer found: the answer held the stop sequence's text ("A: B:" for
    the stop "B: "), though its generation stopped there and its finish_reason said so; streamed, it did not."""
    client, ids = server
    tokenizer = qa.adapter.tokenizer
    tokens = {tokenizer.decode([token]): token for token in range(len(tokenizer))}
    script = [tokens["A"], tokens[": "], tokens["B"], tokens[": "], tokens["C"]]  # the answer "A: B: C"
    made: list[int] = []

    def scripted(module, inputs, logits):  # each answer token the script's next
        forced = torch.full_like(logits, -1e4)
        forced[..., script[min(len(made), len(script) - 1)]] = 1e4
        made.append(1)
        return forced

    hook = qa.adapter.model.get_output_embeddings().register_forward_hook(scripted)
    try:
        made.clear()
        assert _answer(client, ids[0], False, max_tokens=5) == ("A: B: C", "length")
        made.clear()
        whole = _answer(client, ids[0], False, max_tokens=5, stop=stop)
        made.clear()
        streamed = _answer(client, ids[0], True, max_tokens=5, stop=stop)
    finally:
        hook.remove()
    before = "A: B: C"[:"A: B: C".find(stop)]
    assert streamed == (before, "stop")
    assert whole == (before, "stop")  # as streamed: the text before the stop as it stands (it was stripped)


def test_a_chat_question_not_streamed_in_a_batch_that_fails_is_answered_alone(server, monkeypatch):
    """Before: a chat answer not streamed took a streamer (to stop once its client leaves, or at a stop sequence),
    and a question with a streamer whose batch failed was not answered again alone, as one with none is: the
    question that was answered alone before the streamer came was a 500. A streamed one whose batch failed before
    its first token is answered alone too (none of its text was sent)."""
    client, ids = server
    alone = [_answer(client, stream_id, False) for stream_id in ids]
    streamed_alone = _answer(client, ids[0], True, stop="red red")
    together = asking.answer_together

    def failing(questions):  # a batch of more than one fails (a device out of memory, say); one alone does not
        if len(questions) > 1:
            raise RuntimeError("the batch does not fit")
        return together(questions)

    monkeypatch.setattr(asking, "answer_together", failing)
    worker = client.app.state.service.worker
    started, release = threading.Event(), threading.Event()
    busy = threading.Thread(target=worker.run_blocking, args=(lambda: (started.set(), release.wait(30)),))
    busy.start()  # the model's thread is busy while the questions arrive: they are answered together
    assert started.wait(30)
    try:
        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(_answer, client, stream_id, False) for stream_id in ids]
            answers.append(pool.submit(_answer, client, ids[1], True, stop="red red"))
            deadline = time.monotonic() + 30
            while worker.queued < 3:
                assert time.monotonic() < deadline, worker.queued
                time.sleep(0.01)
            release.set()
            answers = [answer.result(timeout=60) for answer in answers]
    finally:
        release.set()
        busy.join(30)
    assert answers[:2] == alone
    assert answers[2][1] == streamed_alone[1] == "stop" and answers[2][0] == alone[1][0][:alone[1][0].find("red red")]
