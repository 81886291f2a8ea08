"""Every check on every path: an iterator is checked as a list is, an option is checked whether or not it is used,
a count says what was read, a command-line argument is never silently ignored, and paths no file can be written
to or read from (empty, too long, a symbolic link loop, a folder made read-only mid-run) are one line; so are an
image that holds less than its header promises and beam search over a stream.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

import statekv
from statekv import Stream
from statekv.cli import main
from statekv.errors import ConfigurationError, InputError, VideoError
from statekv.models import load_adapter
from statekv.synthetic.benchmark import make_benchmark
from statekv.testing import make_tiny_checkpoint, write_test_video
from statekv.video import ImageError, decode_image, open_video

from hostile import noise_frames, small_qa

LONG = "n" * 300  # longer than any file name a file system takes (255 bytes)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    os.symlink(root / "loop-b", root / "loop-a")
    os.symlink(root / "loop-a", root / "loop-b")
    return {"root": root, "model": make_tiny_checkpoint("internvl", root / "internvl"),
            "video": write_test_video(root / "clip.mp4", frames=8, fps=4), "loop": root / "loop-a"}


@pytest.fixture(scope="module")
def adapter(files):
    return load_adapter(files["model"])


def _cli(capsys, *argv) -> tuple[int, str]:
    try:
        code = main([str(arg) for arg in argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) <= 1 and "Traceback" not in err, err
    return code, lines[0] if lines else ""


# ---------------------------------------------------------------------------------------------------------------
# The Python API: iterators as lists, options checked when unused, counts that say what was read
# ---------------------------------------------------------------------------------------------------------------
def test_push_many_checks_a_generator_as_it_checks_a_list(adapter):
    qa, other = small_qa(adapter), small_qa(adapter)
    mine, theirs = qa.stream(horizon_frames=4), other.stream(horizon_frames=4)
    frames = noise_frames(2)
    for items in ([(mine, frames[0], 0.0), (theirs, frames[1], 0.0)],
                  ((stream, frame, 0.0) for stream, frame in ((mine, frames[0]), (theirs, frames[1]))),
                  iter([(mine, frames[0], 0.0), (theirs, frames[1], 0.0)])):
        with pytest.raises(InputError, match="belongs to another VideoQA"):
            qa.push_many(items)
        assert (mine.pushed, theirs.pushed) == (0, 0)  # refused before any frame went anywhere
    with pytest.raises(InputError, match="a list of"):
        qa.push_many(42)


@pytest.mark.parametrize("method", ["statekv", "simplestream"])
def test_an_unknown_retrieval_rule_is_refused_even_when_nothing_is_retrieved(method, files, adapter):
    qa = statekv.VideoQA.from_pretrained(files["model"], method=method, attention="eager", reserve_tokens=40)
    stream = qa.stream(horizon_frames=4)
    stream.push(noise_frames(1)[0])
    with pytest.raises(ConfigurationError, match="unknown retrieval rule 'bogus'"):
        stream.ask("Why?", max_new_tokens=2, retrieval="bogus")
    with pytest.raises(ConfigurationError, match="unknown retrieval rule 'bogus'"):
        stream.ask("Why?", max_new_tokens=2, retrieve=None, retrieval="bogus")
    assert stream.ask("Why?", max_new_tokens=2, retrieval="recent") is not None  # a known rule, unused, is fine


def test_retrieved_frames_counts_only_frames_still_held(adapter, tmp_path):
    probe = small_qa(adapter).stream(horizon_frames=2)
    probe.push(noise_frames(1)[0])
    per_frame = probe.prefill.bytes_per_token * probe.tokens  # one frame's detailed cache (no prompt prefix)
    capped = small_qa(adapter, offload=True, max_cache_bytes=4 * per_frame, cache_limit="evict-oldest").stream(
        horizon_frames=8)
    for frame in noise_frames(7):
        capped.push(frame)
    evicted = capped.stats.evicted_frames
    assert evicted >= 2
    capped.ask("Why?", max_new_tokens=2, retrieve=7)
    assert capped.answer_info.retrieved_frames == capped.frames - evicted  # not the 7 asked for
    capped.ask("Why?", max_new_tokens=2, retrieve=2)
    assert capped.answer_info.retrieved_frames == 2


def test_retrieved_frames_leaves_out_a_frame_kept_whole_as_sinks(adapter):
    """ReKV's sinks may hold a whole frame (the built-in model's 4 tokens a frame): each layer keeps it and chooses
    among the others, so 6 frames held and retrieve=6 or 7 read the sink frame and 5 retrieved ones, as retrieve=5
    does; before, retrieved_frames said 6 and 7 frames were retrieved."""
    probe = small_qa(adapter).stream(horizon_frames=2)
    probe.push(noise_frames(1)[0])
    qa = statekv.VideoQA(adapter, statekv.ReKV(frames=2, sinks=probe.tokens), attention="eager", reserve_tokens=40)
    stream = qa.stream(horizon_frames=8)
    for frame in noise_frames(6):
        stream.push(frame)
    for retrieve, retrieved in ((2, 2), (5, 5), (6, 5), (7, 5)):
        stream.ask("Why?", max_new_tokens=2, retrieve=retrieve)
        assert stream.answer_info.retrieved_frames == retrieved, retrieve
        assert stream.answer_info.read_frames[0] == 0  # the sink frame, at every layer
    assert stream.answer_info.read_frames == tuple(range(6))


def test_kv_cache_dtype_is_checked_when_loading_a_file_set_too(adapter, tmp_path):
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = qa.stream(horizon_frames=4)
    stream.push(noise_frames(1)[0])
    stream.close()
    for value, error in (("int3", ConfigurationError), ("int8", InputError)):
        with pytest.raises(error, match="kv_cache_dtype"):
            Stream.load(stream.prefill.disk.folder, qa, kv_cache_dtype=value)


@pytest.mark.parametrize("kwargs", [{"num_beams": 2}, {"num_beams": 3, "do_sample": True}, {"num_beam_groups": 2}])
def test_beam_search_over_a_stream_is_one_line(kwargs, adapter):
    stream = small_qa(adapter).stream(horizon_frames=4)
    stream.push(noise_frames(1)[0])
    with pytest.raises(InputError) as error:
        stream.ask("Why?", max_new_tokens=2, **kwargs)
    assert "\n" not in str(error.value) and "no beam search" in str(error.value)


def test_max_cache_bytes_takes_a_size_as_text_in_python_as_on_the_command_line():
    assert statekv.ModelOptions(max_cache_bytes="1.5G", cache_limit="evict-oldest").max_cache_bytes == 3 << 29
    assert statekv.EngineSettings(max_cache_bytes="512M").max_cache_bytes == 512 << 20
    with pytest.raises(ConfigurationError, match="a size in bytes such as 512M"):
        statekv.EngineSettings(max_cache_bytes="lots")


def test_a_stream_with_a_very_long_name_lives_saves_and_loads_on_every_tier(adapter, tmp_path):
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path / "cache")
    stream = qa.stream(horizon_frames=4, name=LONG * 20)
    stream.push(noise_frames(1)[0])
    assert len(stream.prefill.disk.folder.name) < 64
    loaded = Stream.load(stream.save(tmp_path / "s.safetensors"), small_qa(adapter))
    assert loaded.name == LONG * 20
    stream.close()
    assert Stream.load(stream.prefill.disk.folder, qa).name == LONG * 20


# ---------------------------------------------------------------------------------------------------------------
# Paths: empty, too long, a symbolic link loop
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["", "  ", LONG + ".mp4", "/tmp/" + "d" * 5000, "loop"])
def test_video_paths_that_name_nothing_readable_are_one_line(source, files, tmp_path, monkeypatch):
    source = str(files["loop"]) if source == "loop" else source
    Image.fromarray(noise_frames(1)[0]).save(tmp_path / "frame_0.png")
    monkeypatch.chdir(tmp_path)  # an empty path is not the current folder, frames and all
    with pytest.raises(VideoError) as error:
        open_video(source)
    assert "\n" not in str(error.value) and len(str(error.value)) < 400


COMMAND_LINES = {
    "answer an empty video path": (["answer", "", "Why?", "--model", "{model}"], "the video path is empty"),
    "answer a name too long": (["answer", LONG + ".mp4", "Why?", "--model", "{model}"], "File name too long"),
    "stream a symbolic link loop": (["stream", "{loop}", "--ask", "1:Why?", "--model", "{model}"],
                                    "Too many levels of symbolic links"),
    "stream --save into a loop": (["stream", "{video}", "--ask", "1:Why?", "--model", "{model}", "--save",
                                   "{loop}/s.safetensors"], "Too many levels of symbolic links"),
    "stream --save a name too long": (["stream", "{video}", "--ask", "1:Why?", "--model", "{model}", "--save",
                                       LONG + ".safetensors"], "File name too long"),
    "eval --out a symbolic link loop": (["eval", "synthetic", "--model", "{model}", "--data-root", "{root}",
                                         "--out", "{loop}"], "Too many levels of symbolic links"),
    "analyze --out a symbolic link loop": (["analyze", "--model", "{model}", "{video}", "--out", "{loop}"],
                                           "Too many levels of symbolic links"),
    "demo --question without --video": (["demo", "--question", "What colour?"], "--question asks about --video"),
    "demo an empty --video": (["demo", "--video", ""], "the video path is empty"),
    "a budget recency never reads": (["answer", "{video}", "Why?", "--model", "{model}", "--method", "recency",
                                      "--budget", "100"], "--budget 100 is not used by --method recency"),
    "frames StateKV never reads": (["stream", "{video}", "--ask", "1:Why?", "--model", "{model}", "--frames", "3"],
                                   "--frames 3 is not used by --method statekv"),
    "sinks full attention never reads": (["eval", "synthetic", "--model", "{model}", "--data-root", "{root}",
                                          "--out", "{root}/run", "--method", "full", "--sinks", "9"],
                                         "--sinks 9 is not used by --method full"),
    "a retrieval rule with nothing retrieved": (["answer", "{video}", "Why?", "--model", "{model}", "--retrieval",
                                                 "rekv"], "give --retrieve K too"),
}


@pytest.mark.parametrize("case", COMMAND_LINES)
def test_command_lines_that_would_ignore_or_mistake_an_argument_are_one_line(case, files, capsys, no_model_loads):
    argv, phrase = COMMAND_LINES[case]
    names = {key: str(value) for key, value in files.items()}
    code, line = _cli(capsys, *(arg.format(**names) for arg in argv))
    assert code == 2 and phrase in line, line


def test_the_retrieval_rule_is_taken_with_retrieve(files, capsys):
    code, _ = _cli(capsys, "answer", files["video"], "Why?", "--model", files["model"], "--retrieve", "2",
                   "--retrieval", "rekv", "--max-new-tokens", "2", "--attention", "eager")
    assert code == 0


# ---------------------------------------------------------------------------------------------------------------
# A run folder made read-only mid-run
# ---------------------------------------------------------------------------------------------------------------
def test_a_run_folder_that_cannot_be_written_mid_run_is_one_line_and_keeps_its_answers(tmp_path, capsys,
                                                                                       monkeypatch):
    import statekv.eval.records as records

    data = make_benchmark(tmp_path / "set", videos=1, seed=3, num_frames=12).parent
    out = tmp_path / "run"

    def read_only(path, rows):  # the folder went read-only after the answers were written
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(records, "write_records_atomically", read_only)
    code, line = _cli(capsys, "eval", "synthetic", "--model", "builtin", "--data-root", data, "--out", out,
                      "--budget", "16", "--no-progress", "--max-new-tokens", "2", "--limit", "2")
    assert code == 2 and f"cannot write {out / 'answers.jsonl'} in the run folder (Permission denied)" in line
    assert "the 2 of 2 answers written before are kept" in line
    monkeypatch.undo()
    code, _ = _cli(capsys, "eval", "synthetic", "--model", "builtin", "--data-root", data, "--out", out, "--budget",
                   "16", "--no-progress", "--max-new-tokens", "2", "--limit", "2")
    assert code == 0 and json.loads((out / "results.json").read_text())["score"]["overall"]["questions"] == 2


@pytest.mark.parametrize("name", ["answers.rank000.jsonl", "answers.jsonl"])
def test_a_folder_where_a_run_keeps_its_answers_is_one_line(tmp_path, capsys, name):
    data = make_benchmark(tmp_path / "set", videos=1, seed=3, num_frames=12).parent
    out = tmp_path / "run"
    (out / name).mkdir(parents=True)
    code, line = _cli(capsys, "eval", "synthetic", "--model", "builtin", "--data-root", data, "--out", out,
                      "--budget", "16", "--no-progress", "--max-new-tokens", "2", "--limit", "2")
    assert code == 2 and f"{out / name} is a folder, not a file of answer records" in line


# ---------------------------------------------------------------------------------------------------------------
# An image that holds less than its header promises
# ---------------------------------------------------------------------------------------------------------------
def _short_png(rows_held: int = 16, rows_promised: int = 32, width: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((rows_held, width, 3), 200, dtype=np.uint8)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    struct.pack_into(">I", data, 20, rows_promised)  # IHDR's height
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))  # and its CRC: a well-formed header
    return bytes(data)


def test_a_png_whose_header_promises_more_rows_than_it_holds_is_refused():
    assert np.asarray(Image.open(io.BytesIO(_short_png())).convert("RGB")).shape == (32, 32, 3)  # PIL fills it in
    with pytest.raises(ImageError) as error:
        decode_image(_short_png(), formats=("PNG", "JPEG"))
    assert error.value.reason == "data" and "promises 32 rows of 32 pixels, its image data holds 16" in str(error.value)
    assert decode_image(_short_png(32, 32)).shape == (32, 32, 3)
    with pytest.raises(ImageError) as error:
        decode_image(_short_png(32, 32), formats=("JPEG",))
    assert error.value.reason == "format"
    with pytest.raises(ImageError) as error:
        decode_image(_short_png(32, 32), max_pixels=100)
    assert error.value.reason == "size"


def test_an_image_past_pillows_own_limit_names_the_limit_asked_for():
    """Before: the message was Pillow's, naming its limit (89,478,485 pixels) and a "DOS attack", where the server
    documents its own (16 MP)."""
    bomb = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(bomb, format="PNG")  # 100 million pixels in a few kilobytes
    with pytest.raises(ImageError) as error:
        decode_image(bomb.getvalue(), formats=("PNG",), max_pixels=16_000_000)
    assert error.value.reason == "size"
    assert str(error.value) == ("the image is too large to decode (an image of 100,000,000 pixels, over the limit of "
                                "16000000 pixels)")
    with pytest.raises(ImageError, match=r"over Pillow's limit of \d+ pixels\)$"):
        decode_image(bomb.getvalue())


def test_a_short_png_among_the_frames_of_a_folder_is_refused_naming_it(adapter, tmp_path):
    for index in range(4):
        Image.fromarray(noise_frames(1, seed=index)[0]).save(tmp_path / f"frame_{index}.png")
    (tmp_path / "frame_2.png").write_bytes(_short_png())
    with pytest.raises(statekv.video.FrameDecodeError) as error:
        small_qa(adapter).encode(tmp_path, vision_batch=1)
    assert "frame_2.png" in str(error.value) and "promises 32 rows" in str(error.value)
    assert error.value.encoded.frames == 2


# ---------------------------------------------------------------------------------------------------------------
# Files this user may not read
# ---------------------------------------------------------------------------------------------------------------
def test_a_folder_annotations_or_a_save_this_user_may_not_read_are_one_line_naming_why(adapter, tmp_path, capsys,
                                                                                        monkeypatch):
    """An image folder that cannot be listed was a traceback from every command that takes a video, an annotation
    file that cannot be read a traceback from `statekv eval`, and a saved stream that cannot be read was said to be
    missing (safetensors' own words): each is now one line saying the permission is what failed."""
    import builtins
    from pathlib import Path

    folder = tmp_path / "frames"
    folder.mkdir()
    Image.fromarray(noise_frames(1)[0]).save(folder / "f0.png")
    data = make_benchmark(tmp_path / "set", videos=1, seed=3, num_frames=12).parent
    stream = small_qa(adapter).stream(horizon_frames=4)
    stream.push(noise_frames(1)[0], 0.0)
    saved = stream.save(tmp_path / "s.safetensors")
    stream.close()
    locked = {folder, data / "questions.jsonl", saved}
    real_open, real_iterdir = builtins.open, Path.iterdir

    def refused(path):
        if Path(path) in locked:
            raise PermissionError(13, "Permission denied", str(path))

    def opening(path, *args, **kwargs):
        refused(path)
        return real_open(path, *args, **kwargs)

    def listing(self):
        refused(self)
        return real_iterdir(self)

    monkeypatch.setattr(builtins, "open", opening)
    monkeypatch.setattr(Path, "iterdir", listing)
    with pytest.raises(VideoError, match="frames: cannot list the folder \\(Permission denied\\)"):
        open_video(folder)
    with pytest.raises(InputError, match="s.safetensors: cannot be read \\(Permission denied\\)"):
        Stream.load(saved, small_qa(adapter))
    code, line = _cli(capsys, "eval", "synthetic", "--model", "builtin", "--data-root", data, "--out", tmp_path / "run",
                      "--no-progress")
    assert code == 2 and line.endswith("questions.jsonl: cannot be read (Permission denied)"), line
