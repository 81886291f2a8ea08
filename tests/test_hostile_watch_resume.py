"""Following a stream's watch events again (the hunt of the events' resume): a client that reconnects with the
last id it read as ``Last-Event-ID`` after watches were deleted (the server restarted meanwhile or not), and the
feed of a stream found damaged as it is brought back, or deleted while its client had fallen behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")

from prometheus_client import CollectorRegistry  # noqa: E402

import statekv.serve.watches as watches_module  # noqa: E402
from statekv.serve import watch_routes  # noqa: E402
from statekv.api.watch import WatchEvent  # noqa: E402
from statekv.serve.watches import FeedEnd, WatchHub  # noqa: E402

import test_hostile_service as service_tests  # noqa: E402
import test_serve_watches as serve_tests  # noqa: E402
from test_hostile_service import KEY, _bare_registry, _moves_fail, _stopped  # noqa: E402
from test_serve_watches import COUNT, Running, followed, push  # noqa: E402

qa, pictures = serve_tests.qa, serve_tests.pictures  # its module's fixtures: one model for both files' tests
short_range = service_tests.short_range


def _watches(client, stream_id: str, count: int) -> list[str]:
    return [client.post(f"/v1/streams/{stream_id}/watches",
                        json={"question": COUNT, "every": 3, "max_new_tokens": 4}).json()["id"] for _ in range(count)]


def _sent(client, stream_id: str, watches: list[str]) -> list[tuple[str, dict]]:
    """The events of ``watches`` (ids, data) in the order they were sent: by frame, a frame's in their order."""
    kept = sorted(((event["frame"], rank), watch, event) for rank, watch in enumerate(watches)
                  for event in client.get(f"/v1/streams/{stream_id}/watches/{watch}").json()["events"])
    return [(f"{event['frame']}.{watch}", {"watch": watch, "question": COUNT, **event}) for _, watch, event in kept]


def _watched(client, pictures, watches: int, frames: int) -> tuple[str, list[str], list[tuple[str, dict]]]:
    """A new stream with ``watches`` watches opened after its third frame and ``frames`` frames pushed in all: its
    id, its watches and the events they sent (`_sent`)."""
    stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
    push(client, stream_id, pictures, 0, 3)
    opened = _watches(client, stream_id, watches)
    push(client, stream_id, pictures, 3, frames)
    return stream_id, opened, _sent(client, stream_id, opened)


def test_a_client_whose_last_event_was_of_a_watch_deleted_since_is_sent_no_event_twice(tmp_path, qa, pictures):
    """Three watches answer at frame 3, in the order they were opened; the client read up to the middle one's
    event, which was then deleted. Before: it was sent every event of frame 3 again, the first watch's (read
    before the one it named) among them."""
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id, (first, middle, last), sent = _watched(client, pictures, 3, 18)
        assert [event_id for event_id, _ in sent[:3]] == [f"3.{first}", f"3.{middle}", f"3.{last}"]
        assert client.delete(f"/v1/streams/{stream_id}/watches/{middle}").status_code == 200
        expected = [item for item in sent[2:] if item[1]["watch"] != middle]
        assert len(expected) >= 2
        assert followed(server, stream_id, len(expected), f"3.{middle}") == expected
        # the first watch's deleted too: its place is remembered as well
        assert client.delete(f"/v1/streams/{stream_id}/watches/{first}").status_code == 200
        expected = [item for item in sent[1:] if item[1]["watch"] == last]
        assert followed(server, stream_id, len(expected), f"3.{first}") == expected


@pytest.mark.parametrize("disk", [False, True])
def test_after_a_restart_a_client_whose_last_event_was_of_a_watch_deleted_before_is_sent_no_event_twice(
        tmp_path, qa, pictures, disk):
    """As above, the server restarted between the deletion and the client's return (what a browser's EventSource
    reconnects after). Before: a restarted server knew nothing of the deleted watch and sent every event of its
    frame again."""
    state = tmp_path / "state"
    with Running(state, qa, disk=disk) as server, server.client() as client:
        stream_id, (first, middle, last), sent = _watched(client, pictures, 3, 18)
        assert client.delete(f"/v1/streams/{stream_id}/watches/{middle}").status_code == 200
    expected = [item for item in sent[2:] if item[1]["watch"] != middle]
    with Running(state, qa, disk=disk) as server:
        assert followed(server, stream_id, len(expected), f"3.{middle}") == expected


def test_a_feed_of_events_ends_at_once_as_its_stream_is_found_damaged_when_brought_back(short_range, tmp_path,
                                                                                        monkeypatch):
    """A stream closed by its stopped handover is found damaged as it is brought back, and quarantined: its
    followers are told at once, as for a deletion. Before: their feeds went on, silent, until their next keep-alive
    (15 s on) found the stream damaged."""
    registry, _ = _bare_registry(short_range[1], tmp_path)
    hub = WatchHub(CollectorRegistry())
    registry.end_watch_feeds = hub.end  # as the app has it
    replace = os.replace
    _moves_fail(monkeypatch)

    async def main() -> None:
        entry = await registry.create(KEY, {"max_fps": None})
        follower = hub.follow(entry.id)
        await _stopped(registry, entry)
        monkeypatch.setattr(os, "replace", replace)
        (entry.tier / "handover.json").write_text("{}")
        with pytest.raises(Exception) as refused:
            await registry.heal(entry)
        assert getattr(refused.value, "status", None) == 409, refused.value
        await asyncio.sleep(0)  # one turn of the loop: the hub's puts (made thread-safe) are run first
        ended = follower.queue.get_nowait()
        assert isinstance(ended, FeedEnd) and f"stream {entry.id} is damaged" in ended.message, ended
        assert "\n" not in ended.message

    try:
        asyncio.run(main())
    finally:
        registry.close_all()
        registry.worker.close()


def test_a_client_fallen_behind_as_its_stream_is_deleted_is_told_it_was_deleted(tmp_path, qa, monkeypatch):
    """Events come faster than the client reads them (its queue full), then the stream is deleted. Before: the end
    of its feed did not fit in its queue either, and the client was told to follow again, as if it had only fallen
    behind (its next try a 404)."""
    monkeypatch.setattr(watches_module, "QUEUED_EVENTS", 1)
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        hub = server.app.state.service.watch_hub
        with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events") as events:
            lines = events.iter_lines()
            assert next(lines).startswith(": following")
            (follower,) = hub.followers[stream_id]
            busy, free = threading.Event(), threading.Event()
            follower.loop.call_soon_threadsafe(lambda: (busy.set(), free.wait(30)))  # the server's loop held
            assert busy.wait(30)
            try:  # meanwhile: two events (one more than its queue holds), then the deletion
                heard, watch = hub.listener(stream_id), SimpleNamespace(id="w_0123abcd", question=COUNT)
                for frame in (1, 2):
                    heard(watch, WatchEvent(frame, float(frame), "A"))
                hub.end(stream_id, f"stream {stream_id} was deleted")
            finally:
                free.set()
            rest = "\n".join(lines)
        assert "event: error" in rest and f"stream {stream_id} was deleted" in rest, rest


def test_a_client_that_cannot_set_headers_resumes_with_the_last_event_id_in_its_url(tmp_path, qa, pictures):
    """A browser's EventSource sets Last-Event-ID only on the reconnections it makes itself; a page that opens a new
    one after a reload names the id in the URL. Before: the query was ignored and every kept event sent again."""
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id, watches, sent = _watched(client, pictures, 3, 12)
        assert len(sent) >= 3
        last_read = sent[0][0]
        assert followed(server, stream_id, len(sent) - 1, params={"last_event_id": last_read}) == sent[1:]
        # an EventSource opened on that URL reconnects to it with the newer id it read since: the header wins
        assert followed(server, stream_id, len(sent) - 2, sent[1][0], params={"last_event_id": last_read}) == sent[2:]
        for params, headers, named in [({"last_event_id": "seven"}, {}, "last_event_id must be the id of an event"),
                                       ({"last_event_id": last_read}, {"Last-Event-ID": "x"}, "Last-Event-ID must")]:
            answer = client.get(f"/v1/streams/{stream_id}/events", params=params, headers=headers)
            assert answer.status_code == 400 and named in answer.json()["error"]["message"], answer.text


@pytest.mark.parametrize("held", ["missed_events", "event_id"])
def test_a_resume_from_an_old_id_gathers_and_writes_its_backlog_while_the_server_answers_others(
        tmp_path, qa, pictures, monkeypatch, held):
    """The backlog of a long history (up to 16 watches of 10,000 events) is gathered (`missed_events`) and written
    as events (each one's `event_id`) off the event loop. Before: on it, and no other request was answered until it
    was done; here the first gathering or writing waits for another request's answer, which the server could not
    give."""
    entered, answered, in_time, heard = threading.Event(), threading.Event(), [], []
    original = getattr(watch_routes, held)

    def slow(*args):
        if not entered.is_set():
            entered.set()
            in_time.append(answered.wait(timeout=30))
        return original(*args)

    monkeypatch.setattr(watch_routes, held, slow)
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id, watches, sent = _watched(client, pictures, 3, 9)
        reader = threading.Thread(target=lambda: heard.extend(
            followed(server, stream_id, len(sent) - 1, sent[0][0])), daemon=True)
        reader.start()
        assert entered.wait(timeout=30)
        try:  # while the backlog is being gathered
            listed = client.get(f"/v1/streams/{stream_id}/watches", timeout=10).status_code
        except httpx.TimeoutException:
            listed = None
        finally:
            answered.set()
        reader.join(timeout=60)
        assert listed == 200 and in_time == [True], "a request made while a backlog was gathered was not answered"
        assert heard == sent[1:]


def test_a_backlog_longer_than_one_part_arrives_whole_in_order_each_event_once(tmp_path, qa, pictures):
    """Two watches keeping more events than one part of a backlog (`watch_routes.BACKLOG_EVENTS`): a client
    following again from the oldest id is sent every later one, in the order they were sent, none twice; the same
    id given twice on the URL is one 400."""
    kept = watch_routes.BACKLOG_EVENTS + 150
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        watches = _watches(client, stream_id, 2)
        for watch in server.app.state.service.registry.entries[stream_id].stream.watches:
            watch.events = [WatchEvent(frame, float(frame), str(frame % 3)) for frame in range(3, 3 + kept)]
        sent = _sent(client, stream_id, watches)
        assert len(sent) == 2 * kept and len({event_id for event_id, _ in sent}) == 2 * kept
        assert followed(server, stream_id, len(sent) - 1, sent[0][0]) == sent[1:]
        twice = client.get(f"/v1/streams/{stream_id}/events",
                           params=[("last_event_id", sent[0][0]), ("last_event_id", sent[1][0])], timeout=10)
        assert twice.status_code == 400 and list(twice.json()) == ["error"]
        assert twice.json()["error"]["message"] == "last_event_id is given 2 times; give it once"


def test_after_a_kill_the_frames_pushed_again_send_their_events_under_new_ids_to_a_client_past_the_save(
        tmp_path, qa, pictures):
    """A server killed after sending events its stream's save does not hold (the save at frame 6, events at 9 and
    later) brings the stream back at 6; the frames pushed again are evaluated again. Before: their events had the
    ids sent before the kill, so a client back with the last id it read (past 6) was sent none of them, and one back
    before the frames were pushed again was sent ids it had read (the numbering began again). Now each run of a
    stream's events after such a kill is numbered anew: a client is sent each new event once, in order, and none
    it read again."""
    state, killed = tmp_path / "state", tmp_path / "killed"
    stream_id, watch = watched_and_stopped(state, qa, pictures)
    with Running(state, qa) as server, server.client() as client:
        push(client, stream_id, pictures, 6, 15)
        before = _sent(client, stream_id, [watch])
        read = followed(server, stream_id, len(before), f"0.{watch}")  # what a client read before the kill
        assert [data for _, data in read] == [data for _, data in before] and read[-1][1]["frame"] > 6
        shutil.copytree(state, killed)  # killed here: its save holds frame 6
    with Running(killed, qa) as server, server.client() as client:
        push(client, stream_id, pictures, 6, 15)  # pushed again
        every = followed(server, stream_id, len(_sent(client, stream_id, [watch])), f"0.{watch}")
        again = [(key, data) for key, data in every if data["frame"] > 6]
        assert [data for _, data in again] == [data for _, data in before if data["frame"] > 6]
        assert not {key for key, _ in again} & {key for key, _ in read}  # none under an id sent before
        assert followed(server, stream_id, len(again), read[-1][0]) == again  # past the save: sent them all
        kept = [item for item in read if item[1]["frame"] <= 6]
        assert followed(server, stream_id, len(kept) - 1 + len(again), kept[0][0]) == kept[1:] + again


def watched_and_stopped(state, qa, pictures) -> tuple[str, str]:
    """A stream served from ``state`` with a count watch opened at frame 3, six frames pushed and the server stopped
    (saved at frame 6): its id and the watch's."""
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        watch = client.post(f"/v1/streams/{stream_id}/watches",
                            json={"question": COUNT, "every": 3, "max_new_tokens": 4}).json()["id"]
        push(client, stream_id, pictures, 3, 6)
    return stream_id, watch
