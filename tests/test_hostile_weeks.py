"""A server running for weeks keeps bounded memory: what each cycle of a stream's life leaves behind is counted
before and after a few cycles (objects, open files, threads, asyncio tasks, entries of the service's own tables,
files in the state folder, metric samples), never timed.

A cycle: a stream made, frames pushed, a question asked (plain, streamed and as an OpenAI streamed chat, one client
going away mid-answer), a watch opened, followed by clients that leave mid-feed, and deleted, requests refused with
4xx, the stream saved and deleted; and a file fed into a stream deleted mid-feed. Each case says what the service
did before.
"""

from __future__ import annotations

import asyncio
import gc
import io
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")
from PIL import Image  # noqa: E402

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.serve.stream_settings import IDLE_MODELS_KEPT  # noqa: E402
from statekv.synthetic.benchmark import make_benchmark  # noqa: E402

from test_serve_watches import KEY, Running as ServerInProcess  # noqa: E402 -- the in-process server

QUESTION = "What colour was the triangle?"


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_options(ModelOptions(model="builtin"))


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    make_benchmark(folder, videos=1, seed=4246, num_frames=24)
    return folder


class Running(ServerInProcess):
    """A server in this process on a free loopback port, whose event loop's tasks can be counted."""

    @property
    def service(self):
        return self.app.state.service

    def tasks(self) -> int:
        """The asyncio tasks of the server's event loop (this count's own left out)."""
        async def count() -> int:
            return len(asyncio.all_tasks()) - 1

        loop = self.server.servers[0].get_loop()
        return asyncio.run_coroutine_threadsafe(count(), loop).result(timeout=30)


def _png(seed: int) -> bytes:
    image = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def _push(client, stream_id: str, seed: int, t: float) -> None:
    pushed = client.post(f"/v1/streams/{stream_id}/frames?t={t}", content=_png(seed),
                         headers={"Content-Type": "image/png"})
    assert pushed.status_code == 200, pushed.text


def _metric(client, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+]+)$", client.get("/metrics").text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


def _wait_for(done, what: str) -> None:
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _statekv_objects() -> Counter:
    gc.collect()
    return Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects()
                   if isinstance(type(o).__module__, str) and type(o).__module__.startswith("statekv"))


def test_streams_of_ever_other_settings_leave_no_model_behind(qa, tmp_path):
    """Before: each distinct choice of method settings (here a budget) made a VideoQA (its step scheduler, batcher
    and carry policy) that the server kept for good, long after its last stream was deleted: 12 streams of 12
    budgets, made and deleted one after the other, left 12 VideoQAs. Now a server keeps those its streams hold,
    and the metrics summed over them (``statekv_batched_steps_total``, ``statekv_step_batch_size``) never go back."""
    cycles = 12
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        settings = server.service.registry.settings
        kept = client.post("/v1/streams", json={"horizon_frames": 16, "budget": 30}).json()["id"]
        _push(client, kept, 1, 0.0)

        def one(budget: int) -> None:
            made = client.post("/v1/streams", json={"horizon_frames": 16, "budget": budget})
            assert made.status_code == 201, made.text
            _push(client, made.json()["id"], budget, 0.0)
            assert client.delete(f"/v1/streams/{made.json()['id']}").status_code == 200

        for budget in range(20, 20 + IDLE_MODELS_KEPT + 1):  # warm-up: as many idle models as are kept
            one(budget)
        models, objects = len(settings.models), _statekv_objects()
        steps = _metric(client, "statekv_step_batch_size_count")
        for budget in range(32, 32 + cycles):
            one(budget)
            now = _metric(client, "statekv_step_batch_size_count")
            assert now >= steps + 1, (now, steps)  # a counter: the steps of the models let go of still count
            steps = now
        grown = {name: count - objects[name] for name, count in _statekv_objects().items()
                 if count - objects[name] >= cycles}
        assert len(settings.models) <= models, (len(settings.models), models)
        assert not grown, grown
        kept_qa = server.service.registry.entries[kept].stream.qa  # the live stream's model stays, and is shared
        again = client.post("/v1/streams", json={"horizon_frames": 16, "budget": 30}).json()["id"]
        assert server.service.registry.entries[again].stream.qa is kept_qa
        idle = list(settings.models.values())  # the models of the settings used last are kept, though idle
        made = client.post("/v1/streams", json={"horizon_frames": 16, "budget": 32 + cycles - 1}).json()["id"]
        assert any(server.service.registry.entries[made].stream.qa is model for model in idle)
        _push(client, kept, 2, 1.0)


def test_streamed_answers_whose_client_left_before_their_first_token_leave_no_task(qa, tmp_path):
    """Before: a streamed answer (``/ask`` with ``"stream": true``, or a streamed chat) whose client went away
    before its first token left a task waiting for a piece that never came (its answer stopped before it began
    ends no streamer): one asyncio task, with its queue and streamer, per such client, freed only by the cyclic
    garbage collector, which then logs "Task was destroyed but it is pending!". Its reply now waits for the
    answer's generation to begin, and a client gone meanwhile leaves no task waiting for it either."""
    drops = 6
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"horizon_frames": 16}).json()["id"]
        _push(client, stream_id, 1, 0.0)
        stopped = _metric(client, "statekv_answers_stopped_total")
        gc.collect()
        gc.disable()  # what only the cyclic collector would free stays countable
        try:
            tasks = server.tasks()
            gate = threading.Event()
            busy = threading.Thread(target=server.service.worker.run_blocking, args=(gate.wait,), daemon=True)
            busy.start()  # the model's thread is busy: no answer begins before its client has gone
            try:
                for number in range(drops):
                    if number % 2:
                        request = (f"/v1/streams/{stream_id}/ask",
                                   {"question": QUESTION, "max_new_tokens": 8, "stream": True})
                    else:
                        request = ("/v1/chat/completions", {
                            "messages": [{"role": "user", "content": QUESTION}], "stream": True, "max_tokens": 8,
                            "statekv": {"stream_id": stream_id}})
                    with pytest.raises(httpx.ReadTimeout), httpx.Client(
                            base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5) as reader:
                        reader.post(request[0], json=request[1])  # no reply before its answer begins: it leaves
                time.sleep(1.5)  # the replies notice their clients have gone
            finally:
                gate.set()
                busy.join(timeout=60)
            _wait_for(lambda: server.service.ask_slots.held == 0, "the dropped answers' replies never ended")
            _wait_for(lambda: _metric(client, "statekv_answers_stopped_total") >= stopped + drops,
                      "the dropped answers were not stopped")
            _wait_for(lambda: server.service.worker.queued == 0, "the model's thread did not finish")
            left = server.tasks() - tasks
        finally:
            gc.enable()
        assert left <= 0, f"{left} tasks left after {drops} streamed answers whose client went away"


def test_a_question_that_fails_on_the_models_thread_leaves_its_stream_to_be_freed_at_once(qa):
    """Before: the failure of a question (or a push) settled on the model's thread held that thread's frame in its
    traceback, and the frame held every stream of its batch: a stream deleted afterwards stayed in memory, its
    whole cache with it, until Python's next full collection, which a long-running server seldom runs."""
    import weakref

    from statekv.serve.worker import ModelWorker

    stream = qa.stream(max_fps=None)
    for second in range(2):
        stream.push(np.asarray(Image.open(io.BytesIO(_png(second)))), float(second))
    gone = weakref.ref(stream)

    def refused(context, tokens):
        raise ValueError("refused after its answer")

    async def asked(asked_of):
        with pytest.raises(ValueError):
            await worker.ask(asked_of, "What colour?", {"max_new_tokens": 2}, before=lambda: None, after=refused)

    worker = ModelWorker()
    collecting = gc.isenabled()
    gc.disable()
    try:
        asyncio.run(asked(stream))
        worker.close()  # its thread done with the question (it settles the future, then returns)
        stream.close()
        del stream
        assert gone() is None, "the stream outlived its last reference"
    finally:
        if collecting:
            gc.enable()


def test_a_deleted_stream_leaves_nothing_in_the_tables_of_refused_pushes_and_failed_heals(qa, tmp_path):
    """Before: a stream deleted while its next push was to be refused (it lost frames when a stopped handover closed
    it, or when its replica stopped) or while bringing it back had failed kept its id in
    ``placement.refusing`` and ``healer.unhealed`` for good: one entry per such stream, never read again."""
    cycles = 6
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        registry = server.service.registry
        for number in range(cycles):
            stream_id = client.post("/v1/streams", json={"horizon_frames": 16}).json()["id"]
            _push(client, stream_id, number, 0.0)
            registry.placement.refuse_next_push(stream_id, "lost 1 frames that waited for their step")
            registry.healer.unhealed[stream_id] = (time.monotonic() - 60, "the folder cannot be written")
            assert client.delete(f"/v1/streams/{stream_id}").status_code == 200
        assert registry.placement.refusing == {} and registry.healer.unhealed == {}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_server_through_many_lifecycles_keeps_its_quantities_flat(qa, tmp_path, media):
    """What a stream's whole life touches, cycle after cycle: nothing grows with the cycles (open files, threads,
    asyncio tasks, statekv objects, the registry's streams, the watch hub's followers, slots held, metric samples,
    files in the state folder). A regression guard: it passed on the main this file was written against."""
    video = str(next(media.rglob("*.mp4")).relative_to(media))
    state = tmp_path / "state"
    with Running(state, qa, media_root=media, save_every_frames=2) as server, server.client() as client:
        service = server.service

        def cycle(number: int) -> None:
            stream_id = client.post("/v1/streams", json={"horizon_frames": 16}).json()["id"]
            for k in range(3):
                _push(client, stream_id, 10 * number + k, float(k))  # saved every second frame
            asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 4})
            assert asked.status_code == 200, asked.text
            with server.client() as reader, reader.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": QUESTION}], "stream": True, "max_tokens": 4,
                    "statekv": {"stream_id": stream_id}}) as chunks:
                assert [line for line in chunks.iter_lines() if line][-1] == "data: [DONE]"
            with server.client() as reader, reader.stream("POST", f"/v1/streams/{stream_id}/ask", json={
                    "question": QUESTION, "max_new_tokens": 32, "stream": True}) as events:
                next(events.iter_lines())  # and goes away mid-answer
            watch = client.post(f"/v1/streams/{stream_id}/watches",
                                json={"question": QUESTION, "every": 1, "max_new_tokens": 4})
            assert watch.status_code == 201, watch.text
            for _ in range(2):  # clients following its events that go away mid-feed
                with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events") as events:
                    next(events.iter_lines())
            _push(client, stream_id, 10 * number + 5, 5.0)
            assert client.post(f"/v1/streams/{stream_id}/ask", json={"question": ""}).status_code == 400
            assert client.get("/v1/streams/st_" + "0" * 24).status_code == 404
            assert httpx.get(server.url + "/v1/streams").status_code == 401
            assert client.delete(f"/v1/streams/{stream_id}/watches/{watch.json()['id']}").status_code == 200
            assert client.delete(f"/v1/streams/{stream_id}").status_code == 200
            fed_id = client.post("/v1/streams", json={"horizon_frames": 64, "max_fps": None}).json()["id"]
            fed: list = []
            feeding = threading.Thread(target=lambda: fed.append(
                client.post(f"/v1/streams/{fed_id}/frames", json={"source": video})))
            feeding.start()
            _wait_for(lambda: fed or service.registry.entries[fed_id].feeding, "the feed did not start")
            assert client.delete(f"/v1/streams/{fed_id}").status_code == 200  # mid-feed
            feeding.join(timeout=60)
            assert fed and fed[0].status_code in (200, 404), fed[0].text

        def measured() -> dict:
            _wait_for(lambda: service.ask_slots.held == 0 and service.follow_slots.held == 0
                      and service.worker.queued == 0, "requests still under way")
            gc.collect()
            return {"fds": _fds(), "threads": threading.active_count(), "tasks": server.tasks(),
                    "streams": len(service.registry.entries), "damaged": len(service.registry.damaged),
                    "followers": sum(len(group) for group in service.watch_hub.followers.values()),
                    "followed streams": len(service.watch_hub.followers),
                    "models": len(service.registry.settings.models),
                    "samples": sum(1 for line in client.get("/metrics").text.splitlines()
                                   if line and not line.startswith("#")),
                    "files": sorted(str(path.relative_to(state)) for path in state.rglob("*") if path.is_file())}

        for number in range(1):  # warm-up: the model's thread, uvicorn's, the loop's executor are started
            cycle(number)
        before, objects = measured(), _statekv_objects()
        cycles = 5
        for number in range(1, 1 + cycles):
            cycle(number)
        after = measured()
        grown = {name: count - objects[name] for name, count in _statekv_objects().items()
                 if count - objects[name] >= cycles}
        assert not grown, grown
        assert after["fds"] <= before["fds"] + 2, (before, after)  # a pooled connection or two, not one per cycle
        assert after["threads"] <= before["threads"] + 1 and after["tasks"] <= before["tasks"], (before, after)
        for name in ("streams", "damaged", "followers", "followed streams", "models", "samples", "files"):
            assert after[name] == before[name], (name, before[name], after[name])


def test_a_save_that_keeps_failing_is_logged_once_counted_and_shown_until_it_saves_again(qa, tmp_path, caplog):
    """Before: a timed save that failed (a read-only or full state folder) was tried again every second and logged
    each time, one ERROR line a second for each stream, while /health said ok and /metrics nothing."""
    import logging

    from statekv.errors import OutputError

    caplog.set_level(logging.WARNING, logger="statekv.serve")
    state = tmp_path / "state"
    with Running(state, qa, save_every_seconds=2) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={}).json()["id"]
        files = server.service.registry.files
        saving = files.save_state

        def read_only(*args, **kwargs):
            raise OutputError(f"stream file {state.resolve()}/streams/x.safetensors: cannot write in "
                              f"{state.resolve()}/streams (Read-only file system)")

        files.save_state = read_only
        try:
            for index in range(2):
                client.post(f"/v1/streams/{stream_id}/frames?t={index}", content=_png(index),
                            headers={"Content-Type": "image/png"}).raise_for_status()
            deadline = time.monotonic() + 60
            while _metric(client, "statekv_save_failures_total") < 1:
                assert time.monotonic() < deadline, client.get("/metrics").text
                time.sleep(0.1)
            time.sleep(4.5)  # tried again every 2 s, not at every check of the save loop (each second)
            assert 2 <= _metric(client, "statekv_save_failures_total") <= 4
            assert client.get("/health").json()["unsaved"] == 1 and _metric(client, "statekv_streams_unsaved") == 1
            shown = client.get(f"/v1/streams/{stream_id}").json()["save_error"]
            assert shown == "stream file streams/x.safetensors: cannot write in streams (Read-only file system)", shown
        finally:
            files.save_state = saving
        deadline = time.monotonic() + 60
        while client.get(f"/v1/streams/{stream_id}").json()["saved"]["frames"] != 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert client.get("/health").json()["unsaved"] == 0 and _metric(client, "statekv_streams_unsaved") == 0
        assert client.get(f"/v1/streams/{stream_id}").json()["save_error"] is None
    said = [record.getMessage() for record in caplog.records if stream_id in record.getMessage()]
    assert len(said) == 2 and said[0].startswith(f"cannot save stream {stream_id}: ") and \
        said[1].startswith(f"stream {stream_id} is saved again"), said
