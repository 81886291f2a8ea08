"""The watch API of `statekv serve` (`statekv.serve.watch_routes`), on a server in this process with the built-in
model: creating, reading and deleting watches, their events as frames are pushed, the stream's server-sent
events, the metrics, watches surviving a restart with their stream, and bad requests."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
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

    def __init__(self, state: Path, qa, disk: bool = False, options: ModelOptions | None = None, **config):
        options = options or ModelOptions(model="builtin")
        if disk:  # streams kept in disk-tier file sets: a restart resumes them there, their watches from records
            options = ModelOptions(model="builtin", offload="disk", offload_dir=str(state.parent / "tiers"))
            qa = qa.with_options(offload="disk", offload_dir=options.offload_dir)
        self.config = ServeConfig(options=options, state_dir=state, api_keys=(KEY, OTHER_KEY), page=False,
                                  **{"save_every_seconds": 600, **config})
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

    def __enter__(self) -> "Running":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


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
            ids: list[str] = []
            following = threading.Event()

            def follow() -> None:
                with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events") as events:
                    following.set()
                    name = None
                    for line in events.iter_lines():
                        if line.startswith("event: "):
                            name = line[len("event: "):]
                        elif line.startswith("id: "):
                            ids.append(line[len("id: "):])
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
            assert heard and heard[0]["watch"] == watch_id and ids == [f"{heard[0]['frame']}.{watch_id}"]
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


def followed(server: Running, stream_id: str, count: int, last_event_id: str | None = None,
             params: dict | None = None) -> list[tuple[str, dict]]:
    """The first ``count`` watch events (id, data) a client following again with ``last_event_id`` (as its header)
    and ``params`` (in its URL) is sent."""
    heard: list[tuple[str, dict]] = []
    headers = {} if last_event_id is None else {"Last-Event-ID": last_event_id}

    def follow() -> None:
        with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events", params=params,
                                                      headers=headers) as events:
            assert events.status_code == 200
            event_id = None
            for line in events.iter_lines():
                if line.startswith("id: "):
                    event_id = line[len("id: "):]
                elif line.startswith("data: "):
                    heard.append((event_id, json.loads(line[len("data: "):])))
                    if len(heard) >= count:
                        return

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    reader.join(timeout=30)
    return heard


def test_a_client_following_again_with_its_last_event_id_is_sent_the_events_it_missed(tmp_path, qa, pictures):
    """A browser's EventSource reconnects with the last id it read: the kept events after it come first, in the
    order they were sent (a frame's in the order of its watches), each once, then the live ones."""
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        watches = [client.post(f"/v1/streams/{stream_id}/watches",
                               json={"question": COUNT, "every": 3, "max_new_tokens": 4}).json()["id"]
                   for _ in range(2)]
        push(client, stream_id, pictures, 3, 21)
        sent = sorted(((event["frame"], rank), watch, event)
                      for rank, watch in enumerate(watches)
                      for event in client.get(f"/v1/streams/{stream_id}/watches/{watch}").json()["events"])
        assert len(sent) >= 4 and sent[0][0] == (3, 0) and sent[1][0] == (3, 1)  # both answered at once at frame 3
        expected = [(f"{event['frame']}.{watch}", {"watch": watch, "question": COUNT, **event})
                    for _, watch, event in sent]
        assert followed(server, stream_id, len(sent) - 1, expected[0][0]) == expected[1:]
        assert followed(server, stream_id, len(sent), f"0.{watches[0]}") == expected
        last_frame = sent[-1][0][0]
        at_last = [item for item in expected if item[0].startswith(f"{last_frame}.")]
        assert followed(server, stream_id, len(at_last), f"{last_frame}.w_gone") == at_last  # a deleted watch's
        for bad in ("soon", "w_1", "-3.w_1", "3.", "\u00b2.w_1".encode("latin-1")):  # "²": a digit, not an int
            refused = client.get(f"/v1/streams/{stream_id}/events", headers={"Last-Event-ID": bad})
            assert refused.status_code == 400 and list(refused.json()) == ["error"], bad
            assert "Last-Event-ID" in refused.json()["error"]["message"]


def test_clients_following_events_past_the_limit_get_429_until_one_leaves(tmp_path, qa):
    with Running(tmp_path / "state", qa, max_followers=1) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events") as events:
            lines = events.iter_lines()  # kept: a closed iterator closes the connection
            assert next(lines).startswith(": following")
            assert metric(client, "statekv_watch_followers") == 1
            refused = client.get(f"/v1/streams/{stream_id}/events", timeout=10)
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "5"
            assert list(refused.json()) == ["error"] and "following watch events" in refused.json()["error"]["message"]
        deadline = time.monotonic() + 30  # the server sees the first client leave at its next keepalive at the latest
        while metric(client, "statekv_watch_followers") and time.monotonic() < deadline:
            time.sleep(0.2)
        with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events") as events:
            assert events.status_code == 200


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
            # a question that cannot fit a horizon stream's room: 413, as asked, whether it holds frames yet or not
            # (before: accepted on an empty stream to fail at every evaluation, a 409 on one with frames)
            short = client.post("/v1/streams", json={"horizon_frames": 2}).json()["id"]
            for frames in (0, 1):
                push(client, short, pictures, frames - 1, frames) if frames else None
                too_long = {"question": "Which colours came? " * 300, "every": 1, "max_new_tokens": 8}
                refused = client.post(f"/v1/streams/{short}/watches", json=too_long)
                assert refused.status_code == 413, refused.text
                assert re.fullmatch(r"the question \(\d+ tokens\) and answer \(8\) do not fit in the \d+ tokens left "
                                    r"before the stream's horizon; .*", refused.json()["error"]["message"])
                asked = client.post(f"/v1/streams/{short}/ask", json={"question": too_long["question"]})
                assert asked.status_code == (413 if frames else 409), asked.text
                assert client.get(f"/v1/streams/{short}/watches").json()["data"] == []
    finally:
        server.stop()


def test_watches_made_and_deleted_at_once_by_many_clients_are_recorded_as_they_last_stood(tmp_path, qa, pictures,
                                                                                          caplog):
    """Every write of a stream's record was built before it was written and written under one partial file name, so
    two at once renamed each other's file (a 'cannot record' error each) and an older record could land last: watches
    answered deleted came back after a restart."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 2)
        statuses: list[int] = []

        def churn(worker: int) -> None:
            with server.client() as own:
                for round_ in range(8):
                    made = own.post(f"/v1/streams/{stream_id}/watches",
                                    json={"question": f"{COUNT} {worker}-{round_}", "every": 100})
                    statuses.append(made.status_code)
                    if round_ < 7:  # each client keeps its last one
                        statuses.append(own.delete(f"/v1/streams/{stream_id}/watches/{made.json()['id']}")
                                        .status_code)

        workers = [threading.Thread(target=churn, args=(worker,)) for worker in range(8)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert sorted(set(statuses)) == [200, 201]
        live = {watch["id"] for watch in client.get(f"/v1/streams/{stream_id}/watches").json()["data"]}
        assert len(live) == 8
        assert "cannot record" not in caplog.text  # no write undid another's
        assert {watch["id"] for watch in json.loads((state / "streams" / f"{stream_id}.json").read_text())
                ["watches"]} == live  # the record holds what was answered last, no save since
        assert not list((state / "streams").glob("*.partial"))
    with Running(state, qa) as server, server.client() as client:  # a restart
        assert {watch["id"] for watch in client.get(f"/v1/streams/{stream_id}/watches").json()["data"]} == live


def test_a_feed_of_events_ends_with_an_error_event_as_its_stream_is_deleted(tmp_path, qa, pictures):
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        lines: list[str] = []
        following, ended = threading.Event(), threading.Event()

        def follow() -> None:
            with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events") as events:
                following.set()
                lines.extend(events.iter_lines())
            ended.set()

        threading.Thread(target=follow, daemon=True).start()
        assert following.wait(30)
        time.sleep(0.2)
        deleting = time.monotonic()
        assert client.delete(f"/v1/streams/{stream_id}").status_code == 200
        assert ended.wait(10) and time.monotonic() - deleting < 5  # not at the next keep-alive, 15 s on
        assert "event: error" in lines and f'"stream {stream_id} was deleted"' in "".join(lines)


def test_a_watch_asked_for_as_its_stream_is_deleted_is_a_404_and_writes_nothing(tmp_path, qa):
    """The request's stream is found, then deleted while its body is still coming: the watch is refused as the
    stream is, never opened on a closed stream (before: a 400 about its RoPE rotation) nor recorded."""
    import socket
    from urllib.parse import urlsplit

    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        body = json.dumps({"question": COUNT, "every": 3}).encode()
        address = urlsplit(server.url)
        with socket.create_connection((address.hostname, address.port), timeout=30) as raw:
            raw.sendall(f"POST /v1/streams/{stream_id}/watches HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n".encode())
            time.sleep(0.5)  # found: it waits for its body
            assert client.delete(f"/v1/streams/{stream_id}").status_code == 200
            raw.sendall(body)
            answer = b""
            while chunk := raw.recv(65536):  # to the end: the server closes the connection
                answer += chunk
            answer = answer.decode()
        assert answer.startswith("HTTP/1.1 404") and f"no stream '{stream_id}'" in answer, answer
        assert not list((state / "streams").glob(f"{stream_id}*"))


def test_a_stream_that_cannot_be_saved_keeps_its_watches_in_its_record_at_shutdown(tmp_path, pictures):
    """SimpleStream keeps no cache to save: the stream comes back empty, as documented, but its watches come back
    with every evaluation made before the stop (before: as its record last stood, here at the watch's creation)."""
    options = ModelOptions(model="builtin", method="simplestream")
    qa = statekv.VideoQA.from_options(options)
    state = tmp_path / "state"
    with Running(state, qa, options=options) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        made = client.post(f"/v1/streams/{stream_id}/watches",
                           json={"question": COUNT, "every": 3, "max_new_tokens": 4})
        url = f"/v1/streams/{stream_id}/watches/{made.json()['id']}"
        push(client, stream_id, pictures, 3, 12)
        before = client.get(url).json()
        assert before["evaluations"] == 4
    with Running(state, qa, options=options) as server, server.client() as client:  # a restart
        again = client.get(url).json()
        assert again["evaluations"] == before["evaluations"] and again["events"] == before["events"]
    with Running(tmp_path / "often", qa, options=options, save_every_frames=2) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 7)  # each save due: its record alone, no cache to refuse the push
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 7
        asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": COUNT, "max_new_tokens": 3})
        assert asked.status_code == 200, asked.text  # its question encodes its last frames afresh
        assert asked.json()["usage"]["prompt_tokens"] > 0 and asked.json()["answer"]
        chat = client.post("/v1/chat/completions", json={"model": "builtin", "max_tokens": 3, "statekv": {
            "stream_id": stream_id}, "messages": [{"role": "user", "content": COUNT}]})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == asked.json()["answer"]


def test_a_record_is_written_as_it_last_stood_once_per_burst_and_never_once_its_stream_left(qa, pictures):
    """Writes asked for at once while one is under way make one more write, of the state after all of them; none is
    written once the stream moved to another replica or was closed (a closed stream's record would name none of its
    watches: the replica taking it would then close them)."""
    from statekv.serve.entries import StreamEntry

    class Files:
        def __init__(self):
            self.written: list[tuple[int, list[str]]] = []

        def write_record(self, record):
            time.sleep(0.05)
            self.written.append((len(record["answers"]), [watch["id"] for watch in record["watches"]]))

    stream = qa.stream(None, max_fps=None)
    for k in range(3):
        stream.push(np.asarray(Image.open(io.BytesIO(pictures[k])).convert("RGB")), float(k))
    watch = stream.watch(COUNT, every=3)
    entry, files = StreamEntry("st_" + "a" * 24, "owner", {}, None, None, "camera", time.time(), stream), Files()

    def answered(number: int) -> None:
        entry.answers.append({"question": COUNT, "answer": str(number)})
        entry.write_record(files)

    writers = [threading.Thread(target=answered, args=(number,)) for number in range(8)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert len(files.written) < 8 and files.written[-1] == (8, [watch.id])
    for state in ({"moved": True}, {"closed": True}):
        entry.retire(**state)
        stream.close()
        entry.write_record(files)
        assert files.written[-1] == (8, [watch.id]) and len(files.written) < 8
        entry.moved = entry.closed = False


def test_a_server_alone_removes_the_partial_files_writes_cut_short_left(tmp_path, qa):
    """Each atomic write has a partial file of its own: those a kill left between a write and its rename would pile
    up; a server that holds the folder alone removes them as it starts, and a saved stream's partial folder (a moved
    file set's partial copy stays)."""
    state = tmp_path / "state"
    Running(state, qa).stop()
    left = [state / "streams" / "st_0123456789abcdef01234567.json.1a2b3c4d.partial",
            state / "quarantine" / "st_0123456789abcdef01234567.json.5e6f7a8b.partial"]
    for path in left:
        path.parent.mkdir(exist_ok=True)
        path.write_text("{")
    saving = state / "streams" / "st_0123456789abcdef01234567.safetensors.9c0d1e2f.partial"  # a save's folder
    saving.mkdir()
    (saving / ".tmpAbC123").write_bytes(b"safetensors' temporary file")
    moving = state / "quarantine" / "st_0123456789abcdef01234567-1.partial"
    moving.mkdir()
    with Running(state, qa):
        assert not any(path.exists() for path in left) and not saving.exists() and moving.is_dir()



def test_a_record_leaves_the_events_its_save_holds_to_the_save_and_a_crash_or_a_restart_loses_none(tmp_path, qa,
                                                                                                   pictures):
    """The record is written at every answer: it holds a watch's events since the stream's last save, not every
    event the watch ever had (before: all of them, up to 10,000 a watch, at each answer). A server killed (its
    state folder as it stood) and one stopped both bring every event back, from the save and the record."""
    state, body = tmp_path / "state", {"question": COUNT, "every": 3, "max_new_tokens": 4}

    def events(client, stream_id: str, key: str) -> list[dict]:
        return client.get(f"/v1/streams/{stream_id}/watches/{key}").json()["events"]

    def recorded(stream_id: str) -> dict[str, list[dict]]:
        record = json.loads((state / "streams" / f"{stream_id}.json").read_text())
        return {watch["id"]: [{"frame": frame, "seconds": seconds, "answer": answer}
                              for frame, seconds, answer in watch["events"]] for watch in record["watches"]}

    def asked(client, stream_id: str) -> None:  # answered once its record is written
        answer = client.post(f"/v1/streams/{stream_id}/ask", json={"question": COUNT, "max_new_tokens": 3})
        assert answer.status_code == 200, answer.text

    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        first = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]  # an event at frame 3
        push(client, stream_id, pictures, 3, 9)
    with Running(state, qa, save_every_frames=4) as server, server.client() as client:  # saved at 9 as it stopped
        second = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]  # an event at 9, unsaved
        push(client, stream_id, pictures, 9, 12)
        asked(client, stream_id)
        before = {key: events(client, stream_id, key) for key in (first, second)}
        assert before[first][0]["frame"] == 3 and before[second][0]["frame"] == 9
        kept = recorded(stream_id)
        assert kept[first] == [event for event in before[first] if event["frame"] > 9]  # the save holds the rest
        assert kept[second] == before[second]
        shutil.copytree(state, tmp_path / "killed")  # a server killed here: its files as they stand
        push(client, stream_id, pictures, 12, 14)  # saved at 13, before the 14th frame
        asked(client, stream_id)
        assert client.get(f"/v1/streams/{stream_id}").json()["saved"]["frames"] == 13
        after = {key: events(client, stream_id, key) for key in (first, second)}
        assert recorded(stream_id) == {key: [event for event in after[key] if event["frame"] > 13]
                                       for key in (first, second)}
    with Running(tmp_path / "killed", qa) as server, server.client() as client:  # back at its save, frame 9
        for key in (first, second):
            assert events(client, stream_id, key) == [event for event in before[key] if event["frame"] <= 9]
    with Running(state, qa) as server, server.client() as client:  # stopped: saved at 14
        for key in (first, second):
            assert events(client, stream_id, key) == after[key]


def test_a_disk_tier_stream_killed_after_a_save_keeps_the_events_of_a_watch_its_file_set_lacks(tmp_path, qa,
                                                                                                pictures, caplog):
    """A disk-tier stream comes back from its file set, whose last checkpoint can lack a watch (a save makes the
    file set durable and took no checkpoint: its last step had one already): its saves write no copy of the stream,
    so its record keeps that watch's events itself, and a kill loses none of them."""
    state, frames = tmp_path / "a" / "state", pictures * 3
    body = {"question": COUNT, "every": 3, "max_new_tokens": 4}
    with Running(state, qa, disk=True, save_every_frames=63) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, frames, 0, 63)  # its 63rd step checkpointed (every 64 steps, from the first)
        key = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]  # an event at frame 63
        push(client, stream_id, frames, 63, 64)  # saved at 63 first, with no checkpoint
        assert client.get(f"/v1/streams/{stream_id}").json()["saved"]["frames"] == 63
        before = client.get(f"/v1/streams/{stream_id}/watches/{key}").json()["events"]
        assert before and before[0]["frame"] == 63
        record = json.loads((state / "streams" / f"{stream_id}.json").read_text())
        assert [len(watch["events"]) for watch in record["watches"]] == [1] and record["saved_watches"] == []
        assert record["tier_saved"] and not (state / "streams" / f"{stream_id}.safetensors").exists()
        shutil.copytree(tmp_path / "a", tmp_path / "killed")  # a server killed here
    with Running(tmp_path / "killed" / "state", qa, disk=True) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}/watches/{key}").json()["events"][:1] == before[:1]
    assert "events up to frame" not in caplog.text


def _deleted_before_a_later_save(tmp_path, qa, pictures) -> tuple[Path, str, str, list[dict]]:
    """A state folder whose record left both watches' events to the save at 6, one watch deleted since and the
    stream saved at 8 without it, the records since never written (a kill, a full disk). Its folder, the stream,
    the watch kept and its events up to that save."""
    state, body = tmp_path / "state", {"question": COUNT, "every": 3, "max_new_tokens": 4}
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        gone = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]
        kept = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]
        push(client, stream_id, pictures, 3, 6)
    record = state / "streams" / f"{stream_id}.json"
    with Running(state, qa, save_every_frames=2) as server, server.client() as client:
        old = record.read_bytes()  # leaves both watches' events up to frame 6 to the save
        assert json.loads(old)["saved_watches"] == sorted([gone, kept])
        assert client.delete(f"/v1/streams/{stream_id}/watches/{gone}").status_code == 200
        push(client, stream_id, pictures, 6, 9)  # saved at 8, before the 9th frame, without it
        assert client.get(f"/v1/streams/{stream_id}").json()["saved"]["frames"] == 8
        events = client.get(f"/v1/streams/{stream_id}/watches/{kept}").json()["events"]
        shutil.copytree(state, tmp_path / "killed")
    (tmp_path / "killed" / "streams" / f"{stream_id}.json").write_bytes(old)
    return tmp_path / "killed", stream_id, kept, [event for event in events if event["frame"] <= 8]


def test_a_watch_deleted_before_a_save_whose_record_was_never_written_stays_deleted(tmp_path, qa, pictures):
    """A record that left a watch's events to the save, the watch deleted, the stream saved again, and neither
    record after it written: the latest save lacks the watch, so it was deleted before that save and stays deleted
    (before: it came back from the old record, without its events)."""
    killed, stream_id, kept, events = _deleted_before_a_later_save(tmp_path, qa, pictures)
    with Running(killed, qa) as server, server.client() as client:
        assert [watch["id"] for watch in client.get(f"/v1/streams/{stream_id}/watches").json()["data"]] == [kept]
        assert client.get(f"/v1/streams/{stream_id}/watches/{kept}").json()["events"] == events


def test_a_stream_brought_back_from_its_save_reads_it_once_and_a_second_read_failing_brings_back_no_deleted_watch(
        tmp_path, qa, pictures, monkeypatch):
    """The stream comes back from its save, so what the save holds of its watches is known: reading the save again
    costs a second whole download from an object store (`local_state` downloads the whole file, tensors too), and
    a store that does not answer it for a moment (a 503, as `StoreStreamFiles.local_state` raises) brought the
    deleted watch back, without its events."""
    from statekv.serve.errors import ServiceError
    from statekv.serve.store import StreamFiles

    killed, stream_id, kept, events = _deleted_before_a_later_save(tmp_path, qa, pictures)
    reads: list[str] = []
    local_state = StreamFiles.local_state

    @contextlib.contextmanager
    def counted(self, key):
        reads.append(key)
        if len(reads) > 1:  # an object store that does not answer for a moment
            raise ServiceError(503, "the save cannot be read from the object store now; retry")
        with local_state(self, key) as path:
            yield path

    monkeypatch.setattr(StreamFiles, "local_state", counted)
    with Running(killed, qa) as server, server.client() as client:
        assert [watch["id"] for watch in client.get(f"/v1/streams/{stream_id}/watches").json()["data"]] == [kept]
        assert client.get(f"/v1/streams/{stream_id}/watches/{kept}").json()["events"] == events
    assert reads == [stream_id]


def test_a_save_the_object_store_cannot_give_back_now_loses_no_event_of_a_watch_a_file_set_lacks(caplog):
    """A stream brought back from its file set (as a stopped handover's heal does on a replica) that lacks a watch
    whose events up to the save are in the save: the object store not answering for a moment (503) is a retry,
    never those events reopened without, for good (the next save keeps the watch as reopened)."""
    from types import SimpleNamespace

    from statekv.serve.errors import ServiceError
    from statekv.serve.watches import with_saved_events

    class Store:
        @contextlib.contextmanager
        def local_state(self, stream_id):
            raise ServiceError(503, f"stream {stream_id}'s save cannot be read from the object store now; retry")
            yield

    entry = SimpleNamespace(id="st_0123456789abcdef01234567", stream=SimpleNamespace(watches=[]), from_save=False)
    watch = {"id": "w_0123456789abcdef", "events": [[70, 69.0, "B"]]}
    record = {"saved_watches": [watch["id"]], "watches": [watch], "saved": {"frames": 63}}
    with pytest.raises(ServiceError) as refused:
        with_saved_events(entry, record, Store())
    assert refused.value.status == 503 and "are lost" not in caplog.text


def saved_whole(state: Path, stream_id: str, qa) -> None:
    """Give a stopped disk-tier stream of ``state`` a whole save, its record saying its saves are not its file set
    (as one saved before saves made the file set durable instead), so a start without its file set loads it from
    that save."""
    record = state / "streams" / f"{stream_id}.json"
    data, tiers = json.loads(record.read_text()), state.parent / "tiers"
    whole = statekv.Stream.load(tiers / data["tier"], qa.with_options(offload="disk", offload_dir=str(tiers)),
                                stream_id=stream_id, owner=data["owner"])
    whole.save(state / "streams" / f"{stream_id}.safetensors")
    whole.close()
    record.write_text(json.dumps({**data, "tier_saved": False}))


def test_a_stream_moved_to_a_new_file_set_records_the_watches_its_record_reopened(tmp_path, qa, pictures):
    """A disk-tier stream whose file set is gone comes back from its save into a new one, and its record is written
    at once to name it: that record names the watches made since the save too (before: it was written before they
    were reopened from the old record, so a kill then lost them for good)."""
    body = {"question": COUNT, "every": 3, "max_new_tokens": 4}
    with Running(tmp_path / "a" / "state", qa, disk=True) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        saved = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]
    saved_whole(tmp_path / "a" / "state", stream_id, qa)
    with Running(tmp_path / "a" / "state", qa, disk=True) as server, server.client() as client:
        made = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]  # after the save at 3
        shutil.copytree(tmp_path / "a" / "state", tmp_path / "b" / "state")  # killed; its file set lost with its disk
    record = tmp_path / "b" / "state" / "streams" / f"{stream_id}.json"
    tier = json.loads(record.read_text())["tier"]
    with Running(tmp_path / "b" / "state", qa, disk=True) as server, server.client() as client:
        written = json.loads(record.read_text())  # as a kill now would leave it
        assert written["tier"] != tier and {watch["id"] for watch in written["watches"]} == {saved, made}
        assert {watch["id"] for watch in client.get(f"/v1/streams/{stream_id}/watches").json()["data"]} == \
            {saved, made}


def test_a_heal_the_object_store_cannot_serve_now_leaves_the_file_set_free_for_its_retry(tmp_path, qa, pictures,
                                                                                       monkeypatch):
    """Bringing a disk-tier stream back from its file set (a stopped handover's heal: healing) that lacks a watch
    its save holds, the object store not giving the save back now (503): a retry, so the stream resumed for it is
    closed again and the retry resumes the file set. Before: it was left open, holding the file set's lock, so the
    retry found the folder held and the stream was quarantined."""
    from statekv import ModelOptions
    from statekv.serve import ServeConfig
    from statekv.serve.errors import ServiceError
    from statekv.serve.registry import StreamRegistry
    from statekv.serve.store import StreamFiles
    from statekv.serve.worker import ModelWorker

    state, frames = tmp_path / "a" / "state", pictures * 3
    body = {"question": COUNT, "every": 3, "max_new_tokens": 4}
    monkeypatch.setattr("statekv.serve.registry.saved_in_tier", lambda entry, resume_tiers: False)  # saved whole,
    # as a replica sharing the state folder saves it
    with monkeypatch.context() as earlier:  # a save's sync journals a watch opened since the last step: a file set
        # lacking a watch its save holds is one an earlier statekv saved
        earlier.setattr("statekv.api.durability.Durability.journal_watches", lambda self: False)
        with Running(state, qa, disk=True, save_every_frames=63) as server, server.client() as client:
            stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
            push(client, stream_id, frames, 0, 63)  # its 63rd step checkpointed
            client.post(f"/v1/streams/{stream_id}/watches", json=body)
            push(client, stream_id, frames, 63, 64)  # saved at 63 with no checkpoint: the file set lacks the watch
            shutil.copytree(tmp_path / "a", tmp_path / "b")  # its files as a closed stream leaves them
    tier = tmp_path / "b" / "tiers"
    options = ModelOptions(model="builtin", offload="disk", offload_dir=str(tier))
    config = ServeConfig(options=options, state_dir=tmp_path / "b" / "state", api_keys=(KEY,), page=False,
                         save_every_seconds=600)
    registry = StreamRegistry(config, qa.with_options(offload="disk", offload_dir=str(tier)), ModelWorker())
    record = registry.files.read_record(stream_id)
    try:
        @contextlib.contextmanager
        def unanswered(self, key):
            raise ServiceError(503, f"stream {key}'s save cannot be read from the object store now; retry")
            yield

        with monkeypatch.context() as patched:
            patched.setattr(StreamFiles, "local_state", unanswered)
            with pytest.raises(ServiceError):
                registry.worker.run_blocking(registry.restore_one, record, True)
        healed = registry.worker.run_blocking(registry.restore_one, record, True)  # its retry
        assert healed.stream.frames == 63  # as its file set holds it
        registry.worker.run_blocking(healed.stream.close)
    finally:
        registry.worker.close()


def test_an_object_store_failing_as_it_lists_a_save_loses_no_event_of_a_watch_a_file_set_lacks(caplog):
    """As the 503 of the download: the store failing as its versions are listed or read (`StorageError`, what
    `StoreStreamFiles.local_state` raises then) is a retry, never those events reopened without, for good."""
    from types import SimpleNamespace

    from statekv.serve.errors import StorageError
    from statekv.serve.watches import with_saved_events

    class Store:
        @contextlib.contextmanager
        def local_state(self, stream_id):
            raise StorageError("the object store cannot list streams/st_0123456789abcdef01234567/: 503")
            yield

    entry = SimpleNamespace(id="st_0123456789abcdef01234567", stream=SimpleNamespace(watches=[]), from_save=False)
    watch = {"id": "w_0123456789abcdef", "events": [[70, 69.0, "B"]]}
    record = {"saved_watches": [watch["id"]], "watches": [watch], "saved": {"frames": 63}}
    with pytest.raises(StorageError):
        with_saved_events(entry, record, Store())
    assert "are lost" not in caplog.text


def test_a_simplestream_stream_on_a_server_that_retrieves_by_default_is_watched_also_from_an_older_record(
        qa, pictures, tmp_path):
    """A server started with ``--retrieve 8`` gave that default to every stream, a simplestream one too, and a watch
    opened on it passed it on: refused, since that method retrieves nothing. Its streams take none now, and a record
    written before (its settings and its watch naming the default) is watched after a restart as well."""
    state, options = tmp_path / "state", ModelOptions(model="builtin", retrieve=8)
    with Running(state, qa.with_options(retrieve=8), options=options) as server, server.client() as client:
        made = client.post("/v1/streams", json={"method": "simplestream", "max_fps": None})
        assert made.status_code == 201 and made.json()["settings"]["retrieve"] is None, made.text
        stream_id = made.json()["id"]
        push(client, stream_id, pictures, 0, 3)
        watch = client.post(f"/v1/streams/{stream_id}/watches", json={"question": COUNT, "every": 1})
        assert watch.status_code == 201, watch.text
        watch_id = watch.json()["id"]
        push(client, stream_id, pictures, 3, 4)
        seen = client.get(f"/v1/streams/{stream_id}/watches/{watch_id}").json()
        assert seen["error"] is None and seen["evaluations"] >= 2, seen
    record_path = state / "streams" / f"{stream_id}.json"
    record = json.loads(record_path.read_text())  # as a server before this one wrote it
    record["settings"]["retrieve"] = 8
    record["watches"][0]["retrieve"] = 8
    record_path.write_text(json.dumps(record))
    with Running(state, qa.with_options(retrieve=8), options=options) as server, server.client() as client:
        push(client, stream_id, pictures, 4, 6)
        seen = client.get(f"/v1/streams/{stream_id}/watches/{watch_id}").json()
        assert seen["error"] is None and seen["evaluations"] >= 4, seen
        again = client.post(f"/v1/streams/{stream_id}/watches", json={"question": COUNT, "every": 2})
        assert again.status_code == 201, again.text
