"""The library used for weeks without the server: what a program that encodes, streams, watches, saves, loads and
closes in a loop holds after each cycle (threads, open descriptors, statekv objects, tensors, files on the disk tier)
stays what it held after the first, also when a stream is dropped without `close` or an encoding is stopped by its
progress callback (counts, never timings)."""

from __future__ import annotations

import gc
import os
import threading
import weakref

import pytest
import torch

import statekv
from statekv.models import load_adapter
from statekv.testing import write_test_video

from conftest import random_frames, tiny_qa

FRAMES = random_frames(4)


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    return write_test_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames=8, fps=4)


@pytest.fixture(autouse=True)
def only_the_tests_heap():
    """What the session made before this test frozen: the collections and heap scans below walk only what the test
    makes (late in a full run the whole heap is millions of objects, and each scan took seconds). Objects older than
    the test are counted neither before nor after, so what the test's own use leaves held is compared as before."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def held() -> dict[str, int]:
    """What the process holds now, after a collection (its objects and tensors: those made since the test began)."""
    gc.collect()
    objects = gc.get_objects()
    tensors = [o for o in objects if issubclass(type(o), torch.Tensor)]
    return {"threads": threading.active_count(), "tasks": len(os.listdir("/proc/self/task")),
            "descriptors": len(os.listdir("/proc/self/fd")),
            "statekv objects": sum(isinstance(getattr(type(o), "__module__", None), str)
                                   and type(o).__module__.startswith("statekv") for o in objects),
            "tensors": len(tensors), "tensor bytes": sum(t.untyped_storage().nbytes() for t in tensors)}


def tensor_bytes() -> int:
    """The bytes of every tensor's storage the process holds now, after a collection (`held`'s one figure, in one
    pass over the heap: a long test session's heap is large)."""
    gc.collect()
    return sum(o.untyped_storage().nbytes() for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def no_more(now: dict[str, int], before: dict[str, int]) -> bool:
    """Whether ``now`` holds nothing more than ``before`` (less is no leak: another test's thread may have ended)."""
    return all(now[name] <= before[name] for name in before)


class Stop(Exception):
    pass


def stop_at_the_second_frame(done: int, planned: int) -> None:
    if done >= 2:
        raise Stop


def pushed(stream, frames=FRAMES, start: float = 0.0):
    for index, image in enumerate(frames):
        stream.push(image, start + index)
    return stream


def test_a_disk_tier_stream_dropped_without_close_leaves_no_descriptor_open(adapter, tmp_path):
    """Its files (the layers', the journal, the checkpoint slots, a handover stream's backlog) are closed when it is
    collected, as its folder's lock is: the folder resumes in the same process, and nothing stays open."""
    qa = tiny_qa(adapter, offload="disk", offload_dir=tmp_path)
    folders = []

    def dropped(horizon_frames):
        stream = pushed(qa.stream(horizon_frames=horizon_frames))
        folders.append(stream.folder)  # the stream goes: only its folder's path is kept

    dropped(8)
    before = held()
    for horizon_frames in (8, None, 8, None):  # None: bounded positions, a backlog file for the handover
        dropped(horizon_frames)
        assert held()["descriptors"] <= before["descriptors"], horizon_frames
    for folder in folders:  # each folder's lock went with its stream: it resumes here
        statekv.Stream.load(folder, qa).close()
    assert no_more(held(), before), (held(), before)


def test_an_encoding_on_the_disk_tier_leaves_no_files_once_closed(adapter, video, tmp_path):
    """`VideoQA.encode` under ``offload="disk"`` makes a file set that nothing resumes (`Stream.load` takes a
    stream's): closed, with a ``with`` block or without, or stopped by its progress callback, it leaves nothing in
    ``offload_dir``; no thread or descriptor stays either."""
    qa = tiny_qa(adapter, offload="disk", offload_dir=tmp_path)

    def cycle() -> None:
        with qa.encode(video) as encoded:
            assert encoded.folder.parent == tmp_path and encoded.ask("Why?", max_new_tokens=2)
        assert os.listdir(tmp_path) == []
        qa.encode(video).close()
        assert os.listdir(tmp_path) == []
        with pytest.raises(Stop):
            qa.encode(video, progress=stop_at_the_second_frame)
        assert os.listdir(tmp_path) == []

    cycle()
    before = held()
    for _ in range(3):
        cycle()
        assert no_more(held(), before), (held(), before)


def test_a_cycle_of_the_whole_library_holds_nothing_more_the_next_time(adapter, video, tmp_path):
    """Encode (with and without a ``with`` block, stopped by its callback), a stream pushed, asked, watched, saved,
    loaded and closed, one on the disk tier closed and resumed, one dropped without `close`: after the first cycle,
    every later one ends holding exactly what the first did, and leaves only the disk-tier streams' folders."""
    qa = tiny_qa(adapter)
    disk = tiny_qa(adapter, offload="disk", offload_dir=tmp_path / "tier")
    kept = []

    def cycle(number: int) -> None:
        with qa.encode(video) as encoded:
            encoded.ask("Why?", max_new_tokens=2)
        qa.encode(video).close()
        with pytest.raises(Stop):
            qa.encode(video, progress=stop_at_the_second_frame)
        stream = pushed(qa.stream(horizon_frames=12))
        stream.ask("Why?", max_new_tokens=2)
        watch = stream.watch("Why?", every=2, max_new_tokens=2)
        pushed(stream, FRAMES[:2], 4.0)
        watch.close()
        path = stream.save(tmp_path / "stream.safetensors")
        stream.close()
        resumed = statekv.Stream.load(path, qa)
        pushed(resumed, FRAMES[:1], 6.0).ask("Why?", max_new_tokens=2)
        resumed.close()
        on_disk = pushed(disk.stream(horizon_frames=12))
        kept.append(on_disk.folder.name)
        on_disk.close()
        pushed(statekv.Stream.load(tmp_path / "tier" / kept[-1], disk), FRAMES[:1], 4.0).close()
        pushed(qa.stream(horizon_frames=12), FRAMES[:2])  # dropped without close

    cycle(0)
    first = held()
    for number in range(1, 4):
        cycle(number)
        assert no_more(held(), first), (number, held(), first)
    assert sorted(os.listdir(tmp_path / "tier")) == sorted(kept)
    assert sorted(os.listdir(tmp_path)) == ["stream.safetensors", "tier"]


def test_a_closed_stream_frees_its_cache_at_once_without_the_cyclic_collector(adapter, checkpoint, video, tmp_path):
    """A closed stream, dropped, frees its engines (their caches: gigabytes on a GPU) by reference counting alone:
    a server that made and deleted thousands held them until a full collection, seldom made with hundreds of
    thousands of objects alive. Each use with the collector off: watched, bounded, on the disk tier, under a cache
    limit that evicts, quantized, stepped with another stream, encoded, saved and loaded, simplestream."""
    plain, disk = tiny_qa(adapter), tiny_qa(adapter, offload="disk", offload_dir=tmp_path / "tier")
    evicting = tiny_qa(adapter, offload=True, max_cache_bytes=60_000, cache_limit="evict-oldest")
    quantized = tiny_qa(adapter, kv_cache_dtype="int8")
    recent = statekv.VideoQA.from_pretrained(checkpoint, method="simplestream", window=2, layout="chat",
                                             attention="eager", reserve_tokens=40)

    def watched(qa, **settings):
        stream = qa.stream(**settings)
        watch = stream.watch("Why?", every=2, max_new_tokens=2)
        pushed(stream).ask("Why?", max_new_tokens=2)
        watch.close()
        return [stream]

    def together():
        streams = [plain.stream(horizon_frames=8), plain.stream(horizon_frames=8)]
        for index, image in enumerate(FRAMES):
            plain.push_many([(stream, image, float(index)) for stream in streams])
        return streams

    def encoded():
        with plain.encode(video) as clip:
            clip.ask("Why?", max_new_tokens=2)
        return [clip]

    def loaded():
        path = watched(plain, horizon_frames=12)[0].save(tmp_path / "stream.safetensors")
        return [pushed(statekv.Stream.load(path, plain), FRAMES[:1], 9.0)]

    uses = {"watched": lambda: watched(plain, horizon_frames=12), "bounded": lambda: watched(plain),
            "disk tier": lambda: watched(disk, horizon_frames=12), "evicting": lambda: watched(evicting),
            "int8": lambda: watched(quantized, horizon_frames=12), "stepped together": together,
            "encoded": encoded, "loaded": loaded, "simplestream": lambda: watched(recent, horizon_frames=12)}
    for name, use in uses.items():
        gc.collect()
        gc.disable()
        try:
            streams = use()
            alive = [weakref.ref(held) for stream in streams for held in (stream, *getattr(stream, "engines", ()))]
            for stream in streams:
                stream.close()
            del streams, stream
            assert [held() for held in alive if held() is not None] == [], name
        finally:
            gc.enable()


def test_a_watched_stream_dropped_without_close_is_freed_at_once_and_its_watch_keeps_its_events(adapter, tmp_path):
    """A stream dropped without `Stream.close` while a watch on it is open is freed by reference counting alone
    (the watch held it in a cycle through the stream's watches), on the disk tier too; the watch, still held,
    keeps its events, closes quietly and says in one line that its stream is gone when evaluated."""
    for qa in (tiny_qa(adapter), tiny_qa(adapter, offload="disk", offload_dir=tmp_path / "tier")):
        gc.collect()
        gc.disable()
        try:
            stream = qa.stream(horizon_frames=12)
            watch = stream.watch("Why?", every=2, max_new_tokens=2)
            pushed(stream)
            events = list(watch.events)
            alive = [weakref.ref(held) for held in (stream, *stream.engines)]
            del stream
            assert [held() for held in alive if held() is not None] == []
        finally:
            gc.enable()
        assert watch.events == events and len(events) >= 1
        with pytest.raises(statekv.InputError, match=f"watch {watch.id}: its stream is gone"):
            watch.evaluate()
        watch.close()
        assert watch.closed


def test_a_long_stream_holds_no_more_threads_descriptors_or_files_as_it_goes(adapter, tmp_path):
    """One stream on the disk tier pushed hundreds of small frames, asked and saved every 100 and watched
    throughout: its threads, descriptors and files stay as they were after the first 100 (what grows with it by
    design, its detailed cache and per-step bookkeeping (docs/engine.md), a watch's events and earlier answers up
    to their caps, is not counted here)."""
    stream = tiny_qa(adapter, offload="disk", offload_dir=tmp_path / "tier").stream(horizon_frames=600)
    watch = stream.watch("Why?", every=50, max_new_tokens=2)
    frames = random_frames(8, seed=1, height=8, width=8)
    counts = []
    for index in range(400):
        stream.push(frames[index % 8], float(index))
        if index % 100 == 99:
            stream.ask("Why?", max_new_tokens=2)
            stream.save(tmp_path / "long.safetensors")
            now = held()
            counts.append((now["threads"], now["tasks"], now["descriptors"], len(os.listdir(stream.folder)),
                           len(os.listdir(tmp_path))))
    assert len(counts) == 4 and all(value <= start for row in counts for value, start in zip(row, counts[0])), counts
    assert watch.evaluations >= 400 // 50 and not watch.closed
    stream.close()


def test_a_closed_stream_still_referenced_holds_none_of_its_cache(adapter, video, tmp_path):
    """A closed stream that something still references (a client's variable, a server's task not yet collected)
    holds none of its keys and values: before, it held its whole cache (gigabytes on a GPU) until it was dropped.
    What the process holds with the closed stream kept is compared to what it holds once it is dropped."""
    plain, disk = tiny_qa(adapter), tiny_qa(adapter, offload="disk", offload_dir=tmp_path / "tier")
    quantized = tiny_qa(adapter, kv_cache_dtype="int8")
    capped = tiny_qa(adapter, offload="disk", offload_dir=tmp_path / "capped", max_cache_bytes=60_000,
                     cache_limit="evict-oldest")

    def together():
        streams = [plain.stream(horizon_frames=8), plain.stream(horizon_frames=8)]
        for index, image in enumerate(FRAMES):
            plain.push_many([(stream, image, float(index)) for stream in streams])
        return streams

    uses = {"stream": lambda: [pushed(plain.stream())], "horizon": lambda: [pushed(plain.stream(horizon_frames=8))],
            "disk tier": lambda: [pushed(disk.stream(horizon_frames=8))], "capped": lambda: [pushed(capped.stream())],
            "int8": lambda: [pushed(quantized.stream(horizon_frames=8))], "stepped together": together,
            "encoded": lambda: [plain.encode(video)]}
    for name, use in uses.items():
        streams = use()
        for stream in streams:
            stream.ask("Why?", max_new_tokens=2)
        cache = sum(stream.stats.cache_bytes for stream in streams)
        for stream in streams:
            stream.close()
            assert stream.peak_device_bytes >= 0  # read after the close (under a cache cap: an IndexError)
            for read in (lambda: stream.prefill.carried(0), lambda: stream.prefill.state_dict(),
                         lambda: stream.prefill.detailed_cache):  # before: a wrong error, or a state with no tensors
                with pytest.raises(statekv.InputError, match="closed"):
                    read()
        kept = tensor_bytes()
        del streams, stream
        dropped = tensor_bytes()
        assert cache > 0 and kept - dropped < cache / 10, (name, kept - dropped, cache)
