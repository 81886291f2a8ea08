"""The service's pieces on their own, without a model or a server: keys kept for a state folder, the refusal
over streams no key owns, the state folder's records and its quarantine, messages without server paths, and the
worker that brings together the pushes of streams fed frame after frame."""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from statekv.errors import ConfigurationError  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.serve.app import check_owners  # noqa: E402
from statekv.serve.auth import KeyFile, KeyRing, owner_of  # noqa: E402
from statekv.serve.config import ServeConfig  # noqa: E402
from statekv.serve.errors import public_message  # noqa: E402
from statekv.serve.store import StreamFiles, hold_state_folder  # noqa: E402
from statekv.serve.worker import ModelWorker  # noqa: E402


def test_a_key_is_made_once_per_folder_and_only_its_digest_is_kept(tmp_path):
    made: list[str | None] = []
    threads = [threading.Thread(target=lambda: made.append(KeyFile(tmp_path).make())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    keys = [key for key in made if key is not None]
    assert len(keys) == 1  # servers starting together on one folder: one of them makes it
    text = (tmp_path / "keys.json").read_text()
    assert keys[0] not in text and json.loads(text)["keys"][0]["owner"] == owner_of(keys[0])
    assert not list(tmp_path.glob("*.partial"))
    ring = KeyRing.for_folder(tmp_path, ["given-key"])
    assert ring.owner(keys[0]) == owner_of(keys[0]) and ring.owner("given-key") == owner_of("given-key")
    assert ring.owner("another") is None and ring.owner("") is None


def test_a_made_key_file_is_flushed_to_the_disk_with_its_folder_before_the_key_is_shown(tmp_path, monkeypatch):
    flushed: list[tuple[int, bool]] = []
    real_fsync = os.fsync

    def noting_fsync(handle):
        status = os.fstat(handle)
        flushed.append((status.st_ino, os.path.isdir(f"/proc/self/fd/{handle}")))
        return real_fsync(handle)

    monkeypatch.setattr(os, "fsync", noting_fsync)
    assert KeyFile(tmp_path).make() is not None
    assert ((tmp_path / "keys.json").stat().st_ino, False) in flushed  # its content, before its name
    assert (tmp_path.stat().st_ino, True) in flushed  # its name in the folder


def test_a_made_key_never_starts_with_a_dash_so_a_command_line_can_pass_it(tmp_path, monkeypatch):
    from statekv.cli import build_parser
    from statekv.serve import auth

    drawn = iter(["-Yx3dash", "Yx3plain"])
    monkeypatch.setattr(auth.secrets, "token_urlsafe", lambda size: next(drawn))
    key = KeyFile(tmp_path).make()
    assert key == "Yx3plain"
    assert build_parser().parse_args(["serve", "--api-key", key]).api_key == [key]


def test_no_key_at_all_and_an_unreadable_key_file_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigurationError, match="no API key: pass --api-key"):
        KeyRing.for_folder(tmp_path, [])
    (tmp_path / "keys.json").write_text("{broken")
    with pytest.raises(ConfigurationError, match="keys.json in the state folder is unreadable"):
        KeyRing.for_folder(tmp_path, ["k"])


def _record(files: StreamFiles, stream_id: str, owner: str) -> None:
    files.write_record({"id": stream_id, "owner": owner, "settings": {}, "horizon_frames": 4, "max_fps": 1.0,
                        "name": "s", "created": 0.0})
    files.state_path(stream_id).write_bytes(b"state")


def test_streams_no_accepted_key_owns_stop_a_start_or_are_dropped(tmp_path):
    files = StreamFiles(tmp_path)
    _record(files, "st_" + "a" * 24, owner_of("alice"))
    _record(files, "st_" + "b" * 24, owner_of("bob"))
    (files.folder / "st_broken.json").write_text("{")
    records = files.records()
    assert sum(isinstance(record, Exception) for _, record in records) == 1
    assert files.owners() == {owner_of("alice"): 1, owner_of("bob"): 1}
    config = ServeConfig(options=ModelOptions(model="builtin"), state_dir=tmp_path, api_keys=("alice",))
    check_owners(ServeConfig(options=config.options, state_dir=tmp_path, api_keys=("alice", "bob")),
                 KeyRing.for_folder(tmp_path, ["alice", "bob"]))  # every stream owned: nothing to say
    with pytest.raises(ConfigurationError, match="holds 1 stream of a key this server was not given; pass it "
                                                 "with --api-key"):
        check_owners(config, KeyRing.for_folder(tmp_path, ["alice"]))
    config.drop_unowned_streams = True
    check_owners(config, KeyRing.for_folder(tmp_path, ["alice"]))
    assert files.owners() == {owner_of("alice"): 1} and not files.state_path("st_" + "b" * 24).exists()


def test_a_state_folder_has_one_server_at_a_time(tmp_path):
    state = tmp_path / "state"
    held = hold_state_folder(state, "statekv serve on http://127.0.0.1:1")  # a folder never served: made
    try:
        with pytest.raises(ConfigurationError, match=rf"^the state folder {re.escape(str(state))} is in use by statekv serve on "
                                                     rf"http://127\.0\.0\.1:1 \(process {os.getpid()} on .*; one "
                                                     "state folder has one server"):
            hold_state_folder(state, "statekv serve on http://127.0.0.1:2")
    finally:
        held.release()
    hold_state_folder(state, "statekv serve on http://127.0.0.1:2").release()  # free once its holder let go
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigurationError, match="^--state-dir .*a-file/sub: cannot use it as the state folder"):
        hold_state_folder(tmp_path / "a-file" / "sub", "statekv serve")


@pytest.mark.parametrize("same_file_system", [True, False])
def test_a_file_set_moved_to_quarantine_arrives_whole_and_goes_only_with_its_stream(tmp_path, monkeypatch,
                                                                                   same_file_system):
    import errno
    import os

    files, stream_id = StreamFiles(tmp_path / "state"), "st_" + "c" * 24
    _record(files, stream_id, owner_of("alice"))
    folder = tmp_path / "tier" / "s-1234abcd"
    (folder / "steps").mkdir(parents=True)
    for name, data in (("stream.json", b"{}"), ("lock", b""), ("steps/0.bin", bytes(range(256)) * 64)):
        (folder / name).write_bytes(data)
    before = {path.relative_to(folder): path.read_bytes() for path in folder.rglob("*") if path.is_file()}
    if not same_file_system:  # as when --offload-dir is another disk: a rename is refused
        rename = os.rename

        def across(source, target):
            if Path(source) == folder:
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            return rename(source, target)

        monkeypatch.setattr(os, "rename", across)
    where = files.move_to_quarantine(stream_id, folder)
    moved = tmp_path / "state" / where
    assert where.startswith(f"quarantine/{stream_id}-") and not folder.exists()
    assert {path.relative_to(moved): path.read_bytes() for path in moved.rglob("*") if path.is_file()} == before
    assert files.quarantined(stream_id) == [moved.name] and files.quarantined("st_" + "d" * 24) == []
    files.write_note({"id": stream_id, "owner": owner_of("alice"), "reason": f"moved to {where}"})
    assert files.notes() == {stream_id: files.read_note(stream_id)}
    assert f"{where}" in files.files_of(stream_id) and f"quarantine/{stream_id}.json" in files.files_of(stream_id)
    files.remove(stream_id)
    assert not list((tmp_path / "state").rglob(f"{stream_id}*"))


def test_messages_name_files_as_the_client_gave_them():
    message = "/srv/videos/synth/a.mp4: not a readable video file; /srv/videos/ is the root"
    assert public_message(message, {"/srv/videos/": "", "/srv/videos/synth/a.mp4": "a.mp4"}) == (
        "a.mp4: not a readable video file;  is the root")


class _Stream:
    def __init__(self, qa):
        self.qa = qa


class _QA:
    def __init__(self):
        self.groups: list[int] = []

    def push_many(self, items, return_exceptions=False):
        self.groups.append(len(items))
        return [True] * len(items)


def test_streams_pushing_frame_after_frame_meet_in_one_drain():
    """Two clients each push one frame at a time (the next only once the last is answered): without waiting
    they would take turns forever; the worker waits a few milliseconds for a stream that just pushed."""
    qa, worker = _QA(), ModelWorker(gather_seconds=0.05)
    streams = [_Stream(qa), _Stream(qa)]

    async def client(stream, decode_seconds: float) -> None:
        for _ in range(20):
            await asyncio.to_thread(time.sleep, decode_seconds)  # its next frame is decoded, at its own pace
            await worker.push(stream, None, None, before=lambda: 0, after=lambda context, kept: kept)

    async def both() -> None:
        await asyncio.gather(client(streams[0], 0.001), client(streams[1], 0.006))

    try:
        asyncio.run(both())
    finally:
        worker.close()
    assert sum(qa.groups) == 40 and qa.groups.count(2) >= 12  # most drains step both streams (taking turns: none)


class _Recording(_QA):
    """A `_QA` that records each drain's pushes (stream, frame) in order."""

    def __init__(self):
        super().__init__()
        self.drains: list[list[tuple[int, object]]] = []

    def push_many(self, items, return_exceptions=False):
        self.drains.append([(id(stream), image) for stream, image, _ in items])
        return super().push_many(items, return_exceptions)


def test_a_stream_that_fell_behind_has_one_push_in_every_drain():
    """Pushes queued without waiting for the stream's earlier ones: each drain takes every stream's earliest, so a
    stream three frames behind steps with the others in three drains, its frames in order, each answered as its own."""
    qa, worker = _Recording(), ModelWorker(gather_seconds=0.0)
    behind, other = _Stream(qa), _Stream(qa)
    started = threading.Event()

    async def run() -> list:
        busy = asyncio.ensure_future(worker.run(lambda: (started.set(), time.sleep(0.2))))  # the thread is busy
        await asyncio.to_thread(started.wait)
        answers = [worker.queue_push(behind, frame, None, before=lambda: 0, after=lambda context, kept, f=frame: f)
                   for frame in ("a1", "a2", "a3")]
        answers.append(worker.queue_push(other, "b1", None, before=lambda: 0, after=lambda context, kept: "b1"))
        await busy
        return await asyncio.gather(*answers)

    try:
        assert asyncio.run(run()) == ["a1", "a2", "a3", "b1"]
    finally:
        worker.close()
    assert qa.drains == [[(id(behind), "a1"), (id(other), "b1")], [(id(behind), "a2")], [(id(behind), "a3")]]
    assert worker.queued == 0


def test_a_camera_keeping_up_is_not_waited_for():
    """A stream whose pushes come a frame period after their answers (a camera keeping up) is not waited for:
    another stream's push is drained at once, not after the gathering wait that streams pushing back to back get."""
    qa, worker = _QA(), ModelWorker(gather_seconds=0.2)
    camera, other = _Stream(qa), _Stream(qa)
    push = {"before": lambda: 0, "after": lambda context, kept: kept}

    async def run() -> float:
        for frame in range(3):  # one a second: each a second after its answer
            if frame:
                await asyncio.sleep(1.0)
            await worker.push(camera, None, None, **push)
        await asyncio.sleep(0.02)  # within the 0.25 s a stream that just pushed is watched for
        started = time.monotonic()
        await worker.push(other, None, None, **push)
        return time.monotonic() - started

    try:
        assert asyncio.run(run()) < 0.15  # not the 0.2 s wait
    finally:
        worker.close()


class _Asked:
    """A `VideoQA` stand-in that records each drain's questions (stream, question) and answers with the question."""

    def __init__(self):
        self.drains: list[list[tuple[int, str]]] = []

    def ask_tokens_many(self, items, return_exceptions=False):
        self.drains.append([(id(stream), question) for stream, question, _ in items])
        return [ValueError("no answer") if question == "bad" else question for _, question, _ in items]


def test_questions_that_wait_together_are_answered_in_one_batch():
    """Questions queued while the thread is busy: one drain answers each stream's earliest (the streams of one
    VideoQA in one `ask_tokens_many`), a stream's later question waits for the next drain, and a question whose
    checks or answer fail fails alone."""
    qa, other_qa, worker = _Asked(), _Asked(), ModelWorker()
    first, second, third, elsewhere = _Stream(qa), _Stream(qa), _Stream(qa), _Stream(other_qa)
    started = threading.Event()

    def refused():
        raise LookupError("not here")

    async def run() -> list:
        busy = asyncio.ensure_future(worker.run(lambda: (started.set(), time.sleep(0.2))))  # the thread is busy
        await asyncio.to_thread(started.wait)
        asked = [(first, "a1"), (second, "b1"), (first, "a2"), (third, "bad"), (elsewhere, "e1"), (second, "b2")]
        answers = [worker.queue_ask(stream, question, {}, before=lambda: 0,
                                    after=lambda context, answer: answer.upper()) for stream, question in asked]
        answers.append(worker.queue_ask(third, "c2", {}, before=refused, after=lambda context, answer: answer))
        await busy
        return await asyncio.gather(*answers, return_exceptions=True)

    try:
        results = asyncio.run(run())
    finally:
        worker.close()
    assert results[:3] == ["A1", "B1", "A2"] and results[4:6] == ["E1", "B2"]
    assert isinstance(results[3], ValueError) and isinstance(results[6], LookupError)
    assert qa.drains == [[(id(first), "a1"), (id(second), "b1"), (id(third), "bad")],
                         [(id(first), "a2"), (id(second), "b2")]]
    assert other_qa.drains == [[(id(elsewhere), "e1")]] and worker.queued == 0


def test_a_server_nobody_scrapes_keeps_no_time_of_each_frame(monkeypatch):
    """The frame rate's window was trimmed only when scraped: a server without a scraper kept every frame's time
    (about 31 bytes a frame, for weeks)."""
    import tracemalloc

    import statekv.serve.metrics as metrics_module

    clock = [0.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    metrics = metrics_module.Metrics(lambda: 0, lambda: 0)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(50_000):
            clock[0] += 0.5
            metrics.frame_done()
        grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 200_000, grown
    assert metrics.frames_per_second() == pytest.approx(2.0, rel=0.1)  # two a second, over the window


def test_metrics_show_the_batch_sizes_as_a_histogram():
    """``statekv_step_batch_size``: the language-model forwards by the stream steps each took, read when scraped
    (its sum over its count is the mean batch `statekv bench serve` reports); ``statekv_question_batch_size``: the
    answering batches by the questions each took."""
    from collections import Counter

    from prometheus_client.parser import text_string_to_metric_families

    from statekv.serve.metrics import Metrics

    sizes, questions = Counter({1: 3, 4: 2}), Counter({1: 1, 3: 2})
    metrics = Metrics(lambda: 2, lambda: 0, lambda: 2, lambda: sizes, lambda: questions)
    samples = {(sample.name, sample.labels.get("le")): sample.value
               for family in text_string_to_metric_families(metrics.exposition().decode())
               if family.name == "statekv_step_batch_size" for sample in family.samples}
    assert samples[("statekv_step_batch_size_bucket", "1.0")] == 3
    assert samples[("statekv_step_batch_size_bucket", "2.0")] == 3
    assert samples[("statekv_step_batch_size_bucket", "4.0")] == 5
    assert samples[("statekv_step_batch_size_bucket", "+Inf")] == 5
    assert samples[("statekv_step_batch_size_count", None)] == 5 and samples[("statekv_step_batch_size_sum", None)] == 11
    sizes[16] += 1  # read again at the next scrape
    assert "statekv_step_batch_size_count 6.0" in metrics.exposition().decode()
    asked = {(sample.name, sample.labels.get("le")): sample.value
             for family in text_string_to_metric_families(metrics.exposition().decode())
             if family.name == "statekv_question_batch_size" for sample in family.samples}
    assert asked[("statekv_question_batch_size_bucket", "2.0")] == 1
    assert asked[("statekv_question_batch_size_bucket", "4.0")] == 3
    assert asked[("statekv_question_batch_size_sum", None)] == 7


class _Behind(_Stream):
    """A stream with ``backlog`` steps its successor has yet to replay, due in quiet moments; ``log`` records each
    replay (and the `_Logged` pushes) in the order the model's thread ran them."""

    def __init__(self, qa, backlog: int, log: list[str], replaying: threading.Event | None = None, *,
                 name: str = "replay", failures: int = 0):
        super().__init__(qa)
        self.backlog, self.log, self.replaying, self.name, self.failures = backlog, log, replaying, name, failures
        self.entered = threading.Event()  # a replay began
        self.closed = False

    @property
    def catch_up_due(self) -> bool:
        return self.backlog > 0 and not self.closed

    def catch_up(self, steps=None):
        self.entered.set()
        if self.replaying is not None:
            self.replaying.wait(5)
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the device is gone")
        self.log.append(self.name)
        self.backlog -= steps


class _Logged(_QA):
    def __init__(self, log: list[str]):
        super().__init__()
        self.log = log

    def push_many(self, items, return_exceptions=False):
        self.log.append("push")
        return super().push_many(items, return_exceptions)

    def catch_up_many(self, streams, steps=None):
        for stream in streams:
            stream.catch_up(steps)
        return steps * len(streams)


def _wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


@pytest.mark.parametrize("quiet", [True, False])
def test_quiet_moments_replay_a_streams_backlog_a_step_at_a_time(quiet):
    log: list[str] = []
    qa, worker = _Logged(log), ModelWorker(gather_seconds=0.0, quiet_catch_up=quiet)
    stream = _Behind(qa, 5, log)
    try:
        asyncio.run(worker.push(stream, None, None, before=lambda: 0, after=lambda context, kept: kept))
        assert _wait_for(lambda: stream.backlog == 0, 5.0 if quiet else 0.2) is quiet
        if not quiet:
            assert stream.backlog == 5 and log == ["push"]
    finally:
        worker.close()
    assert worker.quiet_catch_up_steps == (5 if quiet else 0)
    if quiet:
        assert log == ["push"] + ["replay"] * 5


def test_a_waiting_push_goes_before_the_next_quiet_replay():
    """A replay already running finishes (one step), then whatever waits goes first: the pushes queued meanwhile
    are drained before the backlog's next step."""
    log: list[str] = []
    replaying = threading.Event()
    qa, worker = _Logged(log), ModelWorker(gather_seconds=0.0)
    behind, other = _Behind(qa, 3, log, replaying), _Stream(qa)
    push = {"before": lambda: 0, "after": lambda context, kept: kept}

    async def run() -> None:
        await worker.push(behind, None, None, **push)
        assert await asyncio.to_thread(behind.entered.wait, 5)
        queued = worker.queue_push(other, None, None, **push)  # while the first replay waits
        replaying.set()
        await queued

    try:
        asyncio.run(run())
        assert _wait_for(lambda: behind.backlog == 0)
    finally:
        worker.close()
    assert log == ["push", "replay", "push", "replay", "replay"]


@pytest.mark.parametrize("flags, quiet", [((), True), (("--no-quiet-catch-up",), False)])
def test_the_command_line_says_whether_quiet_moments_replay_backlogs(tmp_path, flags, quiet):
    from statekv.cli import build_parser
    from statekv.commands.serve import serve_config

    args = build_parser().parse_args(["serve", "--state-dir", str(tmp_path / "state"), "--api-key", "k", *flags])
    config, _, _ = serve_config(args)
    assert config.quiet_catch_up is quiet


def test_a_state_dir_given_as_a_url_is_refused_in_one_line(tmp_path, monkeypatch):
    """Before: `--state-dir s3://bucket/x` served from a local folder `s3:/bucket/x`: another node found none of its
    streams, without a word."""
    from statekv.cli import build_parser
    from statekv.commands.serve import serve_config

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["serve", "--state-dir", "s3://bucket/x", "--api-key", "k"])
    with pytest.raises(ConfigurationError, match="^--state-dir s3://bucket/x: a URL.*--ray with --store"):
        serve_config(args)
    assert not list(tmp_path.iterdir())


def test_quiet_moments_take_each_model_in_turn_and_let_go_of_streams_no_longer_due():
    """Streams of two models take turns, a step each; a stream closed after its push is never replayed."""
    log: list[str] = []
    replaying = threading.Event()
    first, second = _Logged(log), _Logged(log)
    worker = ModelWorker(gather_seconds=0.0)
    a = _Behind(first, 2, log, replaying, name="a")
    b, c = _Behind(second, 2, log, name="b"), _Behind(second, 2, log, name="c")
    push = {"before": lambda: 0, "after": lambda context, kept: kept}

    async def run() -> None:
        started, go = threading.Event(), threading.Event()
        busy = asyncio.ensure_future(worker.run(lambda: (started.set(), go.wait(5))))  # the three pushes wait together
        await asyncio.to_thread(started.wait, 5)
        pushed = [worker.queue_push(stream, None, None, **push) for stream in (a, b, c)]
        go.set()
        await busy
        await asyncio.gather(*pushed)
        assert await asyncio.to_thread(a.entered.wait, 5)  # the first quiet moment is a's, and waits
        b.closed = True
        replaying.set()

    try:
        asyncio.run(run())
        assert _wait_for(lambda: a.backlog == c.backlog == 0)
    finally:
        worker.close()
    assert [entry for entry in log if entry != "push"] == ["a", "c", "a", "c"]
    assert b.backlog == 2 and worker.quiet_catch_up_steps == 4


def test_a_replay_that_fails_is_logged_and_not_tried_again_until_the_stream_pushes(caplog):
    log: list[str] = []
    qa, worker = _Logged(log), ModelWorker(gather_seconds=0.0)
    stream = _Behind(qa, 2, log, failures=1)
    push = {"before": lambda: 0, "after": lambda context, kept: kept}
    try:
        asyncio.run(worker.push(stream, None, None, **push))
        assert _wait_for(lambda: "the device is gone" in caplog.text)
        time.sleep(0.1)
        assert stream.backlog == 2 and worker.quiet_catch_up_steps == 0  # not tried again meanwhile
        asyncio.run(worker.push(stream, None, None, **push))
        assert _wait_for(lambda: stream.backlog == 0)
    finally:
        worker.close()
    assert worker.quiet_catch_up_steps == 2 and log == ["push", "push", "replay", "replay"]


def test_the_first_token_is_timed_when_generated_though_it_shows_no_text_yet():
    """`statekv_time_to_first_token_seconds` times the first generated token, not the first piece of text: a token
    that completes no character (or a special one) sends nothing to the client yet."""
    import torch
    from statekv.serve.sse import TokenStreamer

    class Spelling:  # token 1 alone decodes to nothing; with token 2 after it, to "ab"
        def decode(self, ids, skip_special_tokens=True):
            return "ab" if ids[-1:] == [2] else ""

    loop, timed = asyncio.new_event_loop(), []
    try:
        streamer = TokenStreamer(Spelling(), loop, timed.append)
        streamer.put(torch.tensor([[7, 8, 9]]))  # the prompt: not an answer token
        assert timed == []
        streamer.put(torch.tensor([], dtype=torch.long))  # nothing generated yet
        assert timed == []
        streamer.put(torch.tensor([1]))
        loop.run_until_complete(asyncio.sleep(0))  # whatever the streamer handed the loop is queued now
        assert len(timed) == 1 and timed[0] >= 0 and streamer.queue.empty()
        streamer.put(torch.tensor([2]))
        streamer.end()
        loop.run_until_complete(asyncio.sleep(0))
        assert len(timed) == 1 and streamer.queue.get_nowait() == "ab"
    finally:
        loop.close()


@pytest.mark.parametrize("pieces, whole", [(["Hi", " ", "\n"], "Hi"), (["Hi", " ", "\ufffd"], "Hi \ufffd"),
                                           (["Hi", " ", "\ufffd", "!"], "Hi \ufffd!")])
def test_an_answers_streamed_pieces_add_up_to_the_answer_given_whole(pieces, whole):
    """Before: the pieces kept an answer's trailing spaces, which the whole answer strips, and never sent a last
    character left incomplete by the answer's end (``\\ufffd`` in the whole answer)."""
    import torch
    from statekv.serve.sse import TokenStreamer

    class Pieces:  # token i decodes to pieces[i]
        def decode(self, ids, skip_special_tokens=True):
            return "".join(pieces[i] for i in ids)

    loop = asyncio.new_event_loop()
    try:
        streamer = TokenStreamer(Pieces(), loop)
        streamer.put(torch.tensor([[7, 8]]))  # the prompt
        for token in range(len(pieces)):
            streamer.put(torch.tensor([token]))
        streamer.end()

        async def sent():
            return [piece async for piece in streamer.pieces()]

        assert "".join(loop.run_until_complete(sent())) == whole == Pieces().decode(list(range(len(pieces)))).strip()
    finally:
        loop.close()


def test_a_server_raises_its_soft_limit_on_open_files_to_its_hard_limit():
    """A disk-tier stream holds a few files a layer open: a server's streams would pass the usual soft limit of
    1,024 long before ``--max-streams`` (about 200 files a stream for a 28-layer model)."""
    import resource

    from statekv.core.disk.open_files import MOST_OPEN_FILES, raise_open_files_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        raise_open_files_limit()
        wanted = MOST_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MOST_OPEN_FILES)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (wanted, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_stream_setting_not_among_its_choices_is_named_as_the_client_sent_it():
    """A retrieval rule (or method) the server does not know is written as JSON in its one-line 400, as every
    other bad setting is: ``"bogus"`` and ``["rekv"]``, not Python's ``'bogus'`` and ``['rekv']``."""
    from statekv.serve.stream_settings import spelt_as_json
    from statekv.settings.methods import retrieval_rule

    for value, written in (("bogus", '"bogus"'), (["rekv"], '["rekv"]'), ({"a": 1}, '{"a": 1}')):
        with pytest.raises(ConfigurationError) as refused:
            retrieval_rule(value)
        message = spelt_as_json(str(refused.value), {"retrieve": 2, "retrieval": value})
        assert message == f"unknown retrieval rule {written}; choose one of attention, rekv, recent"
