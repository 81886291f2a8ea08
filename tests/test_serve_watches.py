"""The watch API of `statekv serve` (`statekv.serve.watch_routes`), on a server in this process with the built-in
model: creating, reading and deleting watches, their events as frames are pushed, the stream's server-sent
events, the metrics, watches surviving a restart with their stream, and bad requests."""

from __future__ import annotations

import io
import json
import re
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
