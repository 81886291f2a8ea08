"""Unusual paths: names as long as a file system allows, names holding a newline or a tab, names a path cannot
reach. Every one is saved to and loaded from as named, or refused in one line that shows it whole."""

from __future__ import annotations

import pytest

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
