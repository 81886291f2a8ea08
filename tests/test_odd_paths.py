"""Unusual paths: names as long as a file system allows, names holding a newline or a tab, names a path cannot
reach. Every one is saved to and loaded from as named, or refused in one line that shows it whole."""

from __future__ import annotations

import pytest

import statekv
from statekv import Stream
from statekv.api.reown import reown
from statekv.cli import main
from statekv.errors import InputError
from statekv.models import load_adapter
from statekv.testing import make_tiny_checkpoint, write_test_video

from hostile import noise_frames, small_qa


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("internvl") / "ckpt")


@pytest.fixture(scope="module")
def qa(checkpoint):
    return small_qa(load_adapter(checkpoint))


@pytest.fixture(scope="module")
def stream(qa):
    stream = qa.stream(horizon_frames=8)
    for index, frame in enumerate(noise_frames(2)):
        stream.push(frame, float(index))
    return stream


def test_a_name_of_255_bytes_is_saved_to_and_loaded(qa, stream, tmp_path):
    name = "é" * 121 + ".safetensors"  # 254 bytes: the save's lock and partial names beside it would pass 255
    target = tmp_path / name
    assert stream.save(target) == target
    assert sorted(path.name for path in tmp_path.iterdir()) == [name]  # no lock nor partial folder left
    assert Stream.load(target, qa).frames == 2


def test_a_name_too_long_to_load_is_one_line(qa, checkpoint, tmp_path, capsys):
    too_long = tmp_path / ("q" * 300)
    with pytest.raises(InputError, match="File name too long"):
        Stream.load(too_long, qa)
    with pytest.raises(InputError, match="File name too long"):
        reown(too_long)
    video = write_test_video(tmp_path / "v.mp4", frames=2, fps=2)
    assert main(["stream", str(video), "--model", str(checkpoint), "--resume", str(too_long)]) == 2
    assert "File name too long" in capsys.readouterr().err


def test_a_path_holding_a_newline_is_shown_whole_on_one_line(checkpoint, tmp_path, capsys):
    video = write_test_video(tmp_path / "v.mp4", frames=2, fps=2)
    target = video / "new\nfolder" / "s.safetensors"  # a folder cannot be made in a file
    assert main(["stream", str(video), "--model", str(checkpoint), "--save", str(target)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "new\\nfolder" in error and "is a file" in error, error
    assert main(["stream", str(video), "--model", str(checkpoint), "--resume", str(tmp_path / "a\nb")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "a\\nb: no such file or folder" in error, error


def _status(argv):
    try:
        return main(argv)
    except SystemExit as exit:  # argparse's refusal
        return exit.code


# each refused before anything loads; a flag after the long name fails fast where it would not be
@pytest.mark.parametrize("flags", [
    ["serve", "--state-dir", "{long}"], ["serve", "--media-root", "{long}"],
    ["serve", "--offload", "disk", "--offload-dir", "{missing}", "--port", "70000"],
    ["answer", "v.mp4", "q?", "--model", "{long}"], ["analyze", "v.mp4", "--model", "{long}", "--out", "out"],
    ["analyze", "v.mp4", "--model", "./m", "--out", "{missing}"], ["flops", "--plot", "{missing}", "--at", "0"],
    ["synthetic", "make", "--out", "{missing}", "--videos", "1", "--seed", "0"],
    ["train-builtin", "--out", "{missing}", "--stop-after", "0"],
    ["eval", "synthetic", "--model", "builtin", "--data-root", ".", "--out", "{missing}", "--limit", "0"],
    ["stream", "v.mp4", "--model", "builtin", "--save", "{missing}"],
])
def test_a_name_too_long_for_the_system_is_refused_in_one_line_naming_its_flag(flags, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    long = str(tmp_path / ("n" * 300))
    argv = [flag.format(long=long, missing=str(tmp_path / "new" / ("n" * 300))) for flag in flags]
    assert _status(argv) == 2
    error = capsys.readouterr().err
    flag = flags[flags.index(next(flag for flag in flags if "{" in flag)) - 1]
    assert error.count("\n") == 1 and flag in error and "File name too long" in error, error
    assert list(tmp_path.iterdir()) == []  # nothing made on the way


def test_a_name_too_long_for_the_system_is_one_line_in_python(tmp_path):
    from statekv.errors import OutputError
    from statekv.settings.values import check_output_dir

    with pytest.raises(OutputError, match="offload_dir .*: File name too long"):
        check_output_dir(tmp_path / "new" / ("n" * 300), "offload_dir")
    with pytest.raises(InputError, match="File name too long"):
        load_adapter(tmp_path / ("n" * 300))
    assert list(tmp_path.iterdir()) == []


def test_load_errors_show_a_path_holding_a_newline_on_one_line(qa, stream, tmp_path):
    from statekv.errors import ForeignFilesError

    junk = tmp_path / "a\nb.safetensors"
    junk.write_bytes(b"not a stream")
    with pytest.raises(InputError) as refused:
        Stream.load(junk, qa)
    assert "\n" not in str(refused.value) and "a\\nb.safetensors: not a saved statekv stream" in str(refused.value)
    saved = stream.save(tmp_path / "c\nd.safetensors")
    with pytest.raises(ForeignFilesError) as refused:
        Stream.load(saved, qa, owner="someone")
    assert "\n" not in str(refused.value) and "c\\nd.safetensors: the stream belongs to no owner" in str(refused.value)
    (tmp_path / "e\nf").mkdir()
    with pytest.raises(InputError) as refused:
        reown(tmp_path / "e\nf")
    assert "\n" not in str(refused.value) and "e\\nf: not a saved stream" in str(refused.value)


def test_the_stream_command_shows_a_path_holding_a_newline_on_one_line(checkpoint, tmp_path, capsys):
    from statekv.settings.values import printable

    video = write_test_video(tmp_path / "v.mp4", frames=2, fps=2)
    junk = tmp_path / "a\nb.safetensors"
    junk.write_bytes(b"not a stream")
    assert main(["stream", str(video), "--model", str(checkpoint), "--save", str(junk)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "a\\nb.safetensors exists and is not a stream this statekv saved" in error \
        and "(not a saved statekv stream" in error, error
    target = tmp_path / "c\nd.safetensors"
    assert main(["stream", str(video), "--model", str(checkpoint), "--save", str(target)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.endswith(f"; saved to {printable(target)}"), summary


def _folder_of(tmp_path, length: int) -> str:
    """A path under ``tmp_path`` (not made) of exactly ``length`` bytes, of names of 200 bytes at most."""
    path = str(tmp_path / "tier")
    while len(path) < length - 201:
        path += "/" + "d" * 200
    return path + "/" + "e" * (length - len(path) - 1)


def test_a_disk_tier_folder_too_deep_for_its_files_is_refused_up_front_in_one_line(qa, checkpoint, tmp_path, capsys):
    """Before: a folder within a file set's depth of the system's path limit was taken, then every step refused
    with "File name too long". Now it is refused where it is given, by VideoQA, from_pretrained and the commands'
    --offload-dir, and a folder one byte shorter streams, its successor's file set inside its own."""
    from pathlib import Path

    from statekv.errors import OutputError
    from statekv.settings.engine import DISK_TIER_DEEPEST

    fits = _folder_of(tmp_path, 4095 - len(DISK_TIER_DEEPEST) - 1)  # the deepest file: 4095 bytes, the most
    deep = fits + "e"
    stream = small_qa(qa.adapter, offload="disk", offload_dir=fits).stream()  # no horizon: a successor too
    stream.push(noise_frames(1)[0])
    assert stream.frames == 1 and stream.successor is not None
    stream.close()
    with pytest.raises(OutputError, match="^offload_dir .*: too deep for the streams' file sets in it"):
        small_qa(qa.adapter, offload="disk", offload_dir=deep)
    with pytest.raises(OutputError, match="^offload_dir .*: too deep for the streams' file sets in it"):
        statekv.VideoQA.from_pretrained(checkpoint, offload="disk", offload_dir=deep)
    for argv in (["answer", "v.mp4", "q?", "--model", str(checkpoint), "--offload", "disk", "--offload-dir", deep],
                 ["serve", "--model", str(checkpoint), "--offload", "disk", "--offload-dir", deep, "--state-dir",
                  str(tmp_path / "state")]):
        assert _status(argv) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "--offload-dir" in error and "too deep for the streams' file sets" in error
    assert not Path(deep).exists() and not (tmp_path / "state").exists()
