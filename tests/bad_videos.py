"""Broken and unusual video files for error-path tests (pipeline, CLI)."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np

from statekv.testing import draw_test_frame, write_test_video


def _silent_audio(container, stream) -> None:
    frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
    frame.sample_rate = 8000
    container.mux(stream.encode(frame))
    container.mux(stream.encode(None))


def not_a_video(folder: Path) -> Path:
    path = folder / "fake.mp4"
    path.write_bytes(b"this is not a video" * 10)
    return path


def truncated(folder: Path) -> Path:
    """A plain mp4 cut in half: its index (at the end) is lost."""
    whole = write_test_video(folder / "whole.mp4", frames=20, fps=10)
    path = folder / "cut.mp4"
    data = whole.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def unknown_codec(folder: Path) -> Path:
    """An mp4 whose sample description names a codec nobody knows (its header damaged)."""
    data = bytearray(write_test_video(folder / "whole.mp4", frames=10, fps=10).read_bytes())
    entry = data.find(b"stsd") + 16  # after the box's type, version and flags, entry count and the entry's size
    data[entry:entry + 4] = b"zzzz"
    path = folder / "unknown_codec.mp4"
    path.write_bytes(bytes(data))
    return path


def cut_after_header(folder: Path, frames: int = 60, fps: int = 30, keep: float = 0.5) -> Path:
    """An mp4 with its index up front (faststart), cut after ``keep`` of its bytes: the header still promises
    every frame, so it opens, and decoding stops in the middle."""
    path = folder / "faststart.mp4"
    with av.open(str(path), "w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for i in range(frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(draw_test_frame(i, (64, 64)), format="rgb24")))
        container.mux(stream.encode(None))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def audio_only(folder: Path) -> Path:
    path = folder / "sound.wav"
    with av.open(str(path), "w") as container:
        _silent_audio(container, container.add_stream("pcm_s16le", rate=8000))
    return path


def add_cover_art(container) -> list:
    """A still picture attached to ``container`` (a file opened for writing) as its cover art: its stream added, its
    packets returned, to be muxed once every stream is added."""
    from av.stream import Disposition

    cover = container.add_stream("mjpeg")
    cover.width, cover.height, cover.pix_fmt = 64, 48, "yuvj420p"
    cover.disposition = Disposition.attached_pic
    picture = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 200, np.uint8), format="rgb24")
    packets = [*cover.encode(picture), *cover.encode(None)]
    for packet in packets:
        packet.pts = packet.dts = 0
    return packets


def audio_with_cover_art(folder: Path) -> Path:
    """An MP3 of a second of silence with its album's cover: a picture, no video."""
    path = folder / "song.mp3"
    with av.open(str(path), "w") as container:
        sound = container.add_stream("libmp3lame", rate=44100)
        sound.layout = "mono"
        container.mux(add_cover_art(container))
        for index in range(40):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1152), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 44100, index * 1152
            container.mux(sound.encode(frame))
        container.mux(sound.encode(None))
    return path


def zero_frames(folder: Path) -> Path:
    """A Matroska file whose video track has no packets (beside an audio track)."""
    path = folder / "empty.mkv"
    with av.open(str(path), "w") as container:
        video = container.add_stream("mpeg4", rate=30)
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        _silent_audio(container, container.add_stream("pcm_s16le", rate=8000))
    return path


def empty_folder(folder: Path) -> Path:
    path = folder / "no_images"
    path.mkdir()
    (path / "readme.txt").write_text("no frames here")
    return path


# name -> (maker, a phrase the one-line error must contain)
BAD_VIDEOS = {
    "missing": (lambda folder: folder / "missing.mp4", "no such file"),
    "no_images": (empty_folder, "no images"),
    "not_a_video": (not_a_video, "not a readable video file"),
    "truncated": (truncated, "not a readable video file"),
    "unknown_codec": (unknown_codec, "codec is unknown"),
    "audio_only": (audio_only, "no video stream"),
    "cover_art": (audio_with_cover_art, "no video stream"),
    "zero_frames": (zero_frames, "no frames"),
}
