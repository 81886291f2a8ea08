"""statekv.video: frame sampling, lazy decoding of every source kind, errors, preprocessing vs transformers."""

from __future__ import annotations

import gc
import importlib.util
import inspect
import itertools
import os
import random
import weakref
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch
from PIL import Image

import bad_videos
from statekv.testing import draw_test_frame, synthetic_timestamps, write_test_video
from frames import read_frame_index
from statekv.video import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    QWEN_MEAN,
    QWEN_STD,
    FrameDecodeError,
    VideoError,
    VideoNotFoundError,
    decode_image,
    internvl_pixel_values,
    num_sampled_frames,
    open_video,
    qwen_frame_size,
    qwen_pixel_values,
    sample_at_rate,
    source_frame_indices,
    temporal_groups,
    uniform_frame_indices,
)
from statekv.video.sampling import reaches, tick

# ---------------------------------------------------------------------------------------------------
# Sampling rule
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "fps", "expected"),
    [(300, 30, 10), (15, 30, 1), (108_000, 30, 512), (600, 1, 512), (100, 1, 100)],
)
def test_num_sampled_frames_fps_cap_then_frame_cap(total, fps, expected):
    assert num_sampled_frames(total, fps) == expected


def test_a_max_fps_near_the_largest_float_is_no_fps_cap():
    """Before: 300 frames / 30 fps * 1e308 overflowed to infinity, and its floor was an OverflowError."""
    assert num_sampled_frames(300, 30, max_fps=1e308) == 512  # the frame cap alone
    assert num_sampled_frames(300, 30, max_fps=1e308, max_frames=40) == 40


def test_ten_second_clip_keeps_segment_centres():
    indices = uniform_frame_indices(300, 30)
    assert indices == [14, 44, 74, 104, 134, 164, 193, 223, 253, 283]
    segment = 299 / 10
    for k, index in enumerate(indices):  # each index is the centre of its segment (int and round: < 1.5 off)
        assert abs(index - segment * (k + 0.5)) < 1.5


def test_half_second_clip_keeps_its_middle_frame():
    assert uniform_frame_indices(15, 30) == [7]


def test_one_hour_keeps_512_frames_about_seven_seconds_apart():
    indices = uniform_frame_indices(108_000, 30)  # one hour at 30 fps, as indices only
    assert len(indices) == 512
    gaps = np.diff(indices)
    assert set(gaps.tolist()) <= {210, 211}
    assert abs(gaps.mean() / 30 - 7.03) < 0.01
    assert indices[0] == 105 and indices[-1] <= 107_999


def test_indices_stay_in_range_and_increase_for_many_lengths():
    for total in range(1, 400, 7):
        for fps in (1, 2.5, 30):
            indices = uniform_frame_indices(total, fps, max_fps=1, max_frames=64)
            assert indices[0] >= 0 and indices[-1] <= total - 1
            if len(indices) < total:
                assert all(b > a for a, b in itertools.pairwise(indices))


def test_sampling_rejects_bad_arguments():
    with pytest.raises(ValueError, match="total_frames"):
        uniform_frame_indices(0, 30)
    with pytest.raises(ValueError, match="fps"):
        uniform_frame_indices(10, 0)


def _stamped(times):
    return [SimpleNamespace(index=i, timestamp=t) for i, t in enumerate(times)]


def test_fixed_rate_sampler_takes_one_frame_per_tick():
    frames = _stamped([i / 30 for i in range(95)])
    assert [f.index for f in sample_at_rate(frames, 1.0)] == [0, 30, 60, 90]
    assert [f.index for f in sample_at_rate(frames, 2.0)] == [0, 15, 30, 45, 60, 75, 90]


def test_a_frame_on_a_tick_is_on_it_at_an_epochs_time():
    """A camera's timestamps are seconds since 1970: a frame at exactly ``k / fps``, as a float, is on tick ``k``
    there too (a fixed epsilon was below the product's rounding: one such frame in 65 fell on the tick before)."""
    rng = random.Random(7)
    for fps in (10, 25, 30, 60, 29.97):
        for _ in range(2000):
            k = rng.randrange(int(fps * 1e9), int(fps * 2e9))
            assert tick(k / fps, fps) == k
    start = 1.7e9 + 0.1
    assert [reaches(start + i / 10, start + (i - 1) / 10 + 0.1) for i in range(1, 200)] == [True] * 199
    assert not reaches(start + 0.05, start + 0.1)


def test_fixed_rate_sampler_does_not_burst_after_a_gap():
    frames = _stamped([0.0, 0.4, 2.7, 2.9, 3.05, 3.5, 4.0])
    assert [f.timestamp for f in sample_at_rate(frames, 1.0)] == [0.0, 2.7, 3.05, 4.0]


def test_fixed_rate_sampler_is_lazy_on_an_endless_stream():
    endless = (SimpleNamespace(timestamp=i / 10) for i in itertools.count())
    kept = list(itertools.islice(sample_at_rate(endless, 2.0), 4))
    assert [f.timestamp for f in kept] == [0.0, 0.5, 1.0, 1.5]


# ---------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """3 s at 30 fps, 64x64."""
    return write_test_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames=90, fps=30, size=(64, 64))


def test_file_metadata(clip):
    video = open_video(clip)
    assert (video.num_frames, video.fps, video.width, video.height) == (90, 30.0, 64, 64)
    assert video.duration == pytest.approx(3.0, abs=1e-3)


def test_file_sample_decodes_the_sampled_frames(clip):
    video = open_video(clip)
    frames = list(video.sample())
    assert [f.index for f in frames] == source_frame_indices(90, 30) == [15, 45, 75]
    protocol = list(video.sample(protocol=True))
    assert [f.index for f in protocol] == uniform_frame_indices(90, 30) == [14, 44, 73]
    for frame in frames + protocol:
        assert frame.image.dtype == np.uint8 and frame.image.shape == (64, 64, 3)
        assert read_frame_index(frame.image) == frame.index  # the pixels are those of that frame
        assert frame.timestamp == pytest.approx(frame.index / 30, abs=1e-6)


def test_file_frames_reads_every_frame_in_order(clip):
    frames = list(open_video(clip).frames())
    assert [f.index for f in frames] == list(range(90))
    assert [read_frame_index(f.image) for f in frames] == list(range(90))


def test_sample_above_the_video_rate_sees_every_frame_once_the_protocol_repeats_them(clip):
    video = open_video(clip)
    frames = list(video.sample(max_fps=60, max_frames=512))
    assert [f.index for f in frames] == list(range(90))
    assert [read_frame_index(f.image) for f in frames] == list(range(90))
    protocol = list(video.sample(max_fps=60, max_frames=512, protocol=True))
    assert [f.index for f in protocol] == video.sample_indices(max_fps=60, protocol=True) and len(protocol) == 180


def test_readings_are_independent_passes(clip):
    video = open_video(clip)
    first = next(video.sample())
    assert [f.index for f in video.sample()] == [15, 45, 75]
    assert first.index == 15


def test_variable_frame_rate_timestamps_come_from_pts(tmp_path):
    path = write_test_video(tmp_path / "vfr.mp4", frames=20, fps=10, vfr=True)
    video = open_video(path)
    frames = list(video.frames())
    expected = synthetic_timestamps(20, 10, vfr=True)
    assert [f.timestamp for f in frames] == pytest.approx(expected, abs=1e-3)
    assert [f.timestamp for f in frames] != pytest.approx([i / video.fps for i in range(20)], abs=1e-3)
    kept = [f.index for f in video.sample_at_rate(2.0)]
    assert kept == [f.index for f in sample_at_rate(_stamped(expected), 2.0)]


def _timed_video(path: Path, times: list[float]) -> Path:
    """A video file (MP4, Matroska or WebM, by its suffix) whose frame ``i`` (`draw_test_frame`) is at ``times[i]``
    seconds."""
    from fractions import Fraction

    with av.open(str(path), "w") as container:
        if path.suffix == ".webm":
            stream = container.add_stream("libvpx-vp9", rate=None, options={"lossless": "1", "deadline": "realtime"})
        else:
            stream = container.add_stream("libx264", rate=None, options={"bf": "0"})
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        stream.time_base = Fraction(1, 1000)
        if path.suffix != ".mp4":  # else the encoder times the frames at its default 24 fps
            stream.codec_context.time_base = Fraction(1, 1000)
        for index, time in enumerate(times):
            frame = av.VideoFrame.from_ndarray(draw_test_frame(index, (64, 32)), format="rgb24")
            frame.pts, frame.time_base = round(time * 1000), Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


@pytest.mark.parametrize("suffix", ["mp4", "mkv", "webm"])
def test_a_variable_frame_rate_is_sampled_evenly_in_time(tmp_path, suffix):
    """Six seconds at 4 fps, then six at 1 fps (a screen recording's busy minute, then a still slide). Before: the
    frames were chosen by index at the average rate, so the busy part took most of them and seconds of the still
    part were never seen; a Matroska or WebM file (which gives no frame count, nor a rate to compare) still was."""
    times = [k / 4 for k in range(24)] + [6.0 + k for k in range(6)]
    video = open_video(_timed_video(tmp_path / f"recording.{suffix}", times))
    kept = list(video.sample(max_fps=1))  # about one a second over the 11 s: the still part's frames too
    seconds = [int(frame.timestamp) for frame in kept]
    assert [read_frame_index(frame.image) for frame in kept] == [frame.index for frame in kept]
    assert seconds == sorted(set(seconds)) and len(kept) >= 10, seconds  # by index: 2 of the 6 still seconds
    assert sum(second >= 6 for second in seconds) >= 5 and [frame.index for frame in video.sample(max_fps=100)] \
        == list(range(30))
    assert video.variable_rate and video.num_frames == 30
    by_index = uniform_frame_indices(30, video.fps, max_fps=1)  # the benchmarks' rule stays by index
    assert [frame.index for frame in video.sample(max_fps=1, protocol=True)] == by_index


@pytest.mark.parametrize("suffix", ["mp4", "mkv"])
def test_a_hole_in_a_files_frames_is_said_once_and_its_frames_go_on(tmp_path, suffix, caplog):
    """A damaged stretch a demuxer resynchronises past leaves its frames' times with a hole and no decoding error.
    Before: its frames went on as if none were missing, and nothing said so (a question timed after the hole was
    answered from fewer frames than its time gives)."""
    import logging

    caplog.set_level(logging.WARNING, logger="statekv.video")
    times = [float(second) for second in [*range(18), *range(24, 40), *range(45, 50)]]
    video = open_video(_timed_video(tmp_path / f"damaged.{suffix}", times))
    for _ in range(2):  # read twice (as each method of `statekv demo --video` does): said once
        assert [frame.timestamp for frame in video.sample_at_rate(1.0)] == times
    assert video.hole == (17.0, 24.0)
    said = [record.getMessage() for record in caplog.records if record.name == "statekv.video"]
    assert said == [f"{video.name}: no frame between 17.00 s and 24.00 s, where its frames come every 1.00 s: a "
                    "damaged stretch its decoder skipped, or a picture that did not change (later holes are not "
                    "said)"], said
    caplog.clear()
    for steady in (_timed_video(tmp_path / f"steady.{suffix}", [k / 4 for k in range(40)]),
                   _timed_video(tmp_path / f"slides.{suffix}", [k / 4 for k in range(24)] + [6.0 + k for k in range(6)])):
        assert len(list(open_video(steady).frames())) in (40, 30)
    assert not [record for record in caplog.records if record.name == "statekv.video"]


@pytest.mark.parametrize("suffix", ["mp4", "mkv"])
def test_a_variable_frame_rate_keeps_the_frame_on_screen_at_each_time(tmp_path, suffix):
    """One frame in even seconds, three in odd ones. Taking the first frame after each time (less half a frame)
    passed over each even second's single frame, on screen the whole second; the frame on screen is taken."""
    times = [second + part / count for second in range(24) for count in [1 if second % 2 == 0 else 3]
             for part in range(count)]
    video = open_video(_timed_video(tmp_path / f"uneven.{suffix}", times))
    assert video.variable_rate
    seconds = [int(frame.timestamp) for frame in video.sample(max_fps=1)]  # 23 or 24 planned, as its file's length
    assert seconds == list(range(len(seconds))) and len(seconds) >= 23, seconds  # each even second's lone frame too


def test_container_without_frame_count_is_counted_by_demuxing(tmp_path):
    path = write_test_video(tmp_path / "clip.mkv", frames=25, fps=25)
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0  # Matroska stores no count: the fallback is needed
    video = open_video(path)
    assert video.num_frames == 25 and not video.variable_rate
    assert [read_frame_index(f.image) for f in video.frames()] == list(range(25))


@pytest.mark.parametrize("suffix", ["mkv", "webm"])
@pytest.mark.parametrize("fps", [1, 30, 60, 120])
def test_a_constant_rate_file_without_a_frame_count_is_sampled_by_index_as_before(tmp_path, suffix, fps):
    """Times rounded to the container's milliseconds are still evenly spaced: the frames kept are those by index."""
    video = open_video(_timed_video(tmp_path / f"steady.{suffix}", [index / fps for index in range(3 * fps)]))
    assert not video.variable_rate and video.num_frames == 3 * fps
    wanted = source_frame_indices(video.num_frames, video.fps, max_fps=0.5 * fps)
    assert [frame.index for frame in video.sample(max_fps=0.5 * fps)] == wanted


@pytest.mark.parametrize("start", [0, 100])
def test_a_matroska_file_without_a_frame_rate_is_sampled_by_its_frames_own_span(tmp_path, start):
    """A Matroska or WebM file whose track gives no frame duration (a browser's MediaRecorder writes such files):
    the demuxer guesses 24 fps. Before: 24 frames a second were assumed, so 1 fps sampling of a 24 s video kept 1
    frame; and a file whose timestamps start at 100 s was taken for one of 124 s cut short after 24."""
    from fractions import Fraction

    path = tmp_path / "recorded.mkv"
    with av.open(str(path), "w", format="matroska") as container:
        stream = container.add_stream("libx264", rate=None)
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        stream.time_base = Fraction(1, 1000)
        for index in range(24):  # one frame a second
            frame = av.VideoFrame.from_ndarray(draw_test_frame(index, (64, 32)), format="rgb24")
            frame.pts, frame.time_base = (start + index) * 1000, Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    with av.open(str(path)) as container:
        assert container.streams.video[0].average_rate == 24  # the guess this is about
    video = open_video(path)
    assert video.fps == pytest.approx(1.0, rel=0.05) and video.duration == pytest.approx(24, abs=1.1)
    kept = [read_frame_index(frame.image) for frame in video.sample(max_fps=1)]
    assert len(kept) >= 23 and kept == sorted(set(kept))
    assert [read_frame_index(frame.image) for frame in video.sample(max_fps=0.25)] == source_frame_indices(
        24, 1.0, max_fps=0.25)  # as a file that gives its rate
    assert not video.variable_rate  # evenly spaced: its guessed rate is no evidence of a variable one


def _encoded(path: Path, frames: int, fps: int, **options) -> Path:
    """A video file (its format by its suffix, or ``options``' format) of ``frames`` frames drawn by
    `draw_test_frame`, encoded with libx264 at its defaults (B-frames: decoding order is not showing order)."""
    with av.open(str(path), "w", **options) as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": "12"})
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        for index in range(frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(draw_test_frame(index, (64, 32)), format="rgb24")))
        container.mux(stream.encode())
    return path


def test_an_mp4_trimmed_at_its_start_by_an_edit_list_reads_the_frames_it_shows(tmp_path):
    """``ffmpeg -ss 1 -c copy`` (or a phone's trim) keeps every packet and an edit list that starts a second in: its
    sample table counts 30 frames, FFmpeg shows the last 20. Before: refused as truncated or corrupt after 20."""
    whole = _encoded(tmp_path / "whole.mp4", 30, 10)
    path = tmp_path / "trimmed.mp4"
    with av.open(str(whole)) as source, av.open(str(path), "w") as trimmed:
        stream = source.streams.video[0]
        copy = trimmed.add_stream_from_template(stream)
        second = int(1 / stream.time_base)
        for packet in source.demux(stream):
            if packet.dts is not None:  # (not the demuxer's last, empty packet)
                packet.pts, packet.dts, packet.stream = packet.pts - second, packet.dts - second, copy
                trimmed.mux(packet)
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 30  # the case: a count over the frames shown
    video = open_video(path)
    assert (video.num_frames, video.fps, video.duration) == (20, 10, pytest.approx(2.0))
    frames = list(video.frames())
    assert [read_frame_index(frame.image) for frame in frames] == list(range(10, 30))
    assert [frame.timestamp for frame in frames] == pytest.approx([index / 10 for index in range(20)])
    assert [frame.index for frame in video.sample(max_fps=1)] == source_frame_indices(20, 10) == [5, 15]
    assert [frame.index for frame in video.sample_at_rate(1)] == [0, 10]
    assert open_video(whole).num_frames == 30


def test_mpeg_ts_parts_joined_end_to_end_read_as_one_video(tmp_path, caplog):
    """``cat a.ts a.ts a.ts``: each part's timestamps start again. Before: the rate was measured over the first part's
    span (76 fps, a 2 s video), one frame was sampled and the fixed-rate reading kept the first part only."""
    import logging

    caplog.set_level(logging.WARNING, logger="statekv.video")
    part = _encoded(tmp_path / "part.ts", 50, 25).read_bytes()
    path = tmp_path / "joined.ts"
    path.write_bytes(part * 3)
    video = open_video(path)
    assert (video.num_frames, video.fps, video.duration) == (150, pytest.approx(25), pytest.approx(6.0, abs=0.05))
    assert video.content_end == pytest.approx(6.0, abs=0.05)
    said = [record.getMessage() for record in caplog.records if record.name == "statekv.video"]
    assert said == [f"{video.name}: its timestamps start again 2 times (parts joined end to end): read as one video "
                    f"of {video.duration:.2f} s, each part timed after the one before"], said
    frames = list(video.frames())
    assert [frame.timestamp for frame in frames] == pytest.approx([index / 25 for index in range(150)], abs=1e-3)
    assert [read_frame_index(frame.image) for frame in frames] == [index % 50 for index in range(150)]
    assert [frame.index for frame in video.sample_at_rate(1)] == [0, 25, 50, 75, 100, 125]
    assert [frame.index for frame in video.sample(max_fps=1)] == source_frame_indices(150, 25) == [
        12, 37, 62, 87, 112, 137]
    assert not video.variable_rate and video.hole is None


def test_times_that_go_back_continue_one_period_after_the_latest():
    """Each part keeps its own spacing; a frame out of order within a part is moved past the latest too."""
    from statekv.video.continuity import Continuous

    continuous = Continuous()
    assert [continuous(time, 1.0) for time in [0, 1, 2, 0.5, 1.5, 0, 1, 1]] == [0, 1, 2, 3, 4, 5, 6, 6]
    assert continuous.restarts == 2


def test_a_sparse_matroska_file_lasts_as_long_as_its_content(tmp_path):
    """Seven frames five seconds apart (a slideshow), its header saying 30.1 s. Before: the duration was taken as
    seven gaps of five seconds, 35 s, so a reading that ended at its last frame was said to be cut short."""
    from fractions import Fraction

    from statekv.video.sources import cut_short

    path = tmp_path / "slides.mkv"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mjpeg", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuvj420p"
        stream.time_base = Fraction(1, 1000)
        for index in range(7):
            frame = av.VideoFrame.from_ndarray(draw_test_frame(index, (64, 32)), format="rgb24")
            frame.pts, frame.time_base = index, Fraction(1, 10)
            for packet in stream.encode(frame):
                packet.pts = packet.dts = index * 5000
                packet.time_base = Fraction(1, 1000)
                container.mux(packet)
    with av.open(str(path)) as container:
        assert container.duration / av.time_base == pytest.approx(30.1)
    video = open_video(path)
    assert (video.num_frames, video.fps, video.duration) == (7, pytest.approx(0.2), pytest.approx(30.1))
    times = [frame.timestamp for frame in video.sample(max_fps=1)]
    assert times == pytest.approx([5.0 * index for index in range(7)])
    assert cut_short(video, times[-1], 1.0) is None


def test_image_folder_in_natural_order(tmp_path):
    for i in range(12):  # frame_2 must come before frame_10
        Image.fromarray(draw_test_frame(i, (64, 32))).save(tmp_path / f"frame_{i}.png")
    (tmp_path / "notes.txt").write_text("not an image")
    video = open_video(tmp_path, fps=2)
    assert (video.num_frames, video.fps, video.duration, video.width, video.height) == (12, 2.0, 6.0, 64, 32)
    frames = list(video.frames())
    assert [read_frame_index(f.image) for f in frames] == list(range(12))
    assert [f.timestamp for f in frames] == [i / 2 for i in range(12)]
    assert [f.index for f in video.sample()] == source_frame_indices(12, 2.0) == [1, 3, 5, 7, 9, 11]
    assert [f.index for f in video.sample(protocol=True)] == uniform_frame_indices(12, 2.0)
    assert open_video(tmp_path).fps == 1.0  # default rate of image sources


def _quadrants(height: int, width: int) -> np.ndarray:
    """A frame no quarter turn or mirror leaves as it is: four colours and a white top-left corner."""
    image = np.zeros((height, width, 3), np.uint8)
    image[:height // 2, :width // 2], image[:height // 2, width // 2:] = (255, 0, 0), (0, 255, 0)
    image[height // 2:, :width // 2], image[height // 2:, width // 2:] = (0, 0, 255), (255, 255, 0)
    image[:4, :4] = 255
    return image


# (display rotation, mirrored left to right, mirrored top to bottom) as PyAV writes them -> the frame as FFmpeg 7.1's
# own tools show it (read with its command line, autorotation on): quarter turns counterclockwise, then a mirror
SHOWN_AS = {(0, False, False): (0, False), (0, False, True): (2, True), (0, True, False): (0, True),
            (0, True, True): (2, False), (90, False, False): (1, False), (90, False, True): (3, True),
            (90, True, False): (1, True), (90, True, True): (3, False), (180, False, False): (2, False),
            (-90, False, False): (3, False), (-90, False, True): (1, True), (-90, True, False): (3, True)}


@pytest.mark.parametrize(("rotation", "hflip", "vflip"), sorted(SHOWN_AS))
def test_a_video_file_is_read_upright_as_its_display_matrix_asks(tmp_path, rotation, hflip, vflip):
    stored = _quadrants(32, 64)
    path = tmp_path / "phone.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=4, options={"qp": "0"})  # lossless but for RGB to YUV rounding
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv444p"
        stream.set_display_rotation(rotation, hflip=hflip, vflip=vflip)
        for _ in range(3):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(stored, format="rgb24")))
        container.mux(stream.encode())
    quarters, mirrored = SHOWN_AS[rotation, hflip, vflip]
    shown = np.rot90(stored, quarters)
    shown = shown[:, ::-1] if mirrored else shown
    video = open_video(path)
    assert (video.width, video.height) == (shown.shape[1], shown.shape[0])
    for frame in [*video.frames(), *video.sample(max_fps=4), *video.sample_at_rate(4)]:
        assert frame.image.shape == shown.shape and np.abs(frame.image.astype(int) - shown).max() <= 2
        assert frame.image.flags.c_contiguous and torch.from_numpy(frame.image).shape == shown.shape


@pytest.mark.parametrize(("orientation", "quarters", "mirrored"), [(1, 0, False), (2, 0, True), (3, 2, False),
                                                                   (4, 2, True), (5, 3, True), (6, 3, False),
                                                                   (7, 1, True), (8, 1, False)])
def test_an_image_is_read_upright_as_its_exif_orientation_asks(tmp_path, orientation, quarters, mirrored):
    stored = _quadrants(32, 64)
    exif = Image.Exif()
    exif[0x0112] = orientation  # EXIF's Orientation tag: how a camera held sideways says to show its picture
    Image.fromarray(stored).save(tmp_path / "photo.png", exif=exif)
    shown = np.rot90(stored, quarters)
    shown = np.ascontiguousarray(shown[:, ::-1] if mirrored else shown)
    video = open_video(tmp_path)
    assert (video.width, video.height) == (shown.shape[1], shown.shape[0])
    np.testing.assert_array_equal(next(video.frames()).image, shown)
    np.testing.assert_array_equal(decode_image((tmp_path / "photo.png").read_bytes()), shown)


@pytest.mark.parametrize(("mode", "values", "expected"), [
    ("I;16", np.array([[0, 257, 32768, 65535]], np.uint16), [0, 1, 128, 255]),
    ("I", np.array([[0, 257, 32768, 65535]], np.int32), [0, 1, 128, 255]),
    ("I", np.array([[-100, 0, 100, 100_000]], np.int32), [0, 0, 1, 255]),  # out of 16-bit range: stretched
    ("F", np.array([[0.0, 0.25, 0.5, 1.0]], np.float32), [0, 64, 128, 255]),
])
def test_grey_of_more_than_8_bits_is_scaled_to_8(tmp_path, mode, values, expected):
    """A 16-bit grey PNG, a 32-bit integer or a float image, as a file, in a folder, as a PIL image and as a frame
    pushed to a stream. Before: PIL's conversion to RGB clipped them, so a 16-bit mid-grey came out white and a float
    image black."""
    from statekv.video.images import rgb_frame

    image = Image.fromarray(values) if mode != "I;16" else Image.fromarray(values).convert("I;16")
    assert image.mode == mode
    name = "grey.png" if mode == "I;16" else "grey.tif"
    image.save(tmp_path / name)
    with Image.open(tmp_path / name) as saved:
        assert saved.mode == mode
    shown = np.repeat(np.array(expected, np.uint8)[None, :, None], 3, axis=2)
    np.testing.assert_array_equal(decode_image((tmp_path / name).read_bytes()), shown)
    np.testing.assert_array_equal(next(open_video(tmp_path).frames()).image, shown)
    np.testing.assert_array_equal(next(open_video([image]).frames()).image, shown)
    np.testing.assert_array_equal(rgb_frame(image), shown)


def test_array_and_image_list_sources_agree():
    array = np.stack([draw_test_frame(i, (48, 16)) for i in range(5)])
    from_array = list(open_video(array, fps=5).frames())
    from_images = list(open_video([Image.fromarray(a) for a in array], fps=5).frames())
    for a, b in zip(from_array, from_images, strict=True):
        assert (a.index, a.timestamp) == (b.index, b.timestamp)
        np.testing.assert_array_equal(a.image, b.image)
    assert [f.timestamp for f in from_array] == [0.0, 0.2, 0.4, 0.6, 0.8]


@pytest.mark.parametrize("size", [(16, 16), (400, 40), (40, 400)])
def test_small_and_odd_aspect_one_frame_videos(tmp_path, size):
    path = write_test_video(tmp_path / "one.mp4", frames=1, fps=30, size=size)
    video = open_video(path)
    frames = list(video.sample())
    assert video.num_frames == 1 and [f.index for f in frames] == [0]
    assert frames[0].image.shape == (size[1], size[0], 3)


def test_large_frame(tmp_path):
    path = write_test_video(tmp_path / "big.mp4", frames=1, fps=30, size=(4000, 3000))
    (frame,) = open_video(path).sample()
    assert frame.image.shape == (3000, 4000, 3)
    assert internvl_pixel_values(frame.image, 448).shape == (3, 448, 448)
    assert qwen_frame_size(3000, 4000, min_pixels=64 * 32 * 32, max_pixels=768 * 32 * 32) == (768, 1024)


# ---------------------------------------------------------------------------------------------------
# Errors: one clear line each
# ---------------------------------------------------------------------------------------------------


def _error_for(source, **kwargs) -> VideoError:
    with pytest.raises(VideoError) as info:
        video = open_video(source, **kwargs)
        list(video.frames())
    message = str(info.value)
    assert message and "\n" not in message
    return info.value


def test_missing_path(tmp_path):
    error = _error_for(tmp_path / "missing.mp4")
    assert isinstance(error, VideoNotFoundError) and isinstance(error, FileNotFoundError)
    assert "no such file" in str(error)


def test_folder_without_images(tmp_path):
    (tmp_path / "readme.txt").write_text("no frames here")
    assert "no images" in str(_error_for(tmp_path))


def test_not_a_video_file(tmp_path):
    assert "not a readable video file" in str(_error_for(bad_videos.not_a_video(tmp_path)))


def test_truncated_file_without_index(clip, tmp_path):
    data = clip.read_bytes()  # the index (moov) of a plain mp4 is at the end: cutting loses it
    path = tmp_path / "cut.mp4"
    path.write_bytes(data[: len(data) // 2])
    message = str(_error_for(path))  # before: the FFmpeg error alone ("Invalid data found when processing input")
    assert "not a readable video file" in message and "an MP4 cut short before its index was written" in message
    assert "\n" not in message


def test_a_file_cut_inside_its_index_says_so(clip, tmp_path):
    """Before: "the file has no video stream", for a video whose index alone was cut short."""
    data = clip.read_bytes()
    path = tmp_path / "cut.mp4"
    path.write_bytes(data[: data.find(b"moov") + 100])
    message = str(_error_for(path))
    assert "no video stream" in message and "cut short before its index was written" in message


def test_truncated_file_with_index_up_front(tmp_path):
    path = bad_videos.cut_after_header(tmp_path)
    assert open_video(path).num_frames == 60  # the header still promises every frame
    assert "decoding stopped after" in str(_error_for(path))
    with pytest.raises(FrameDecodeError, match="truncated") as info:
        list(open_video(path).sample(max_fps=30))
    error = info.value  # names the frame that could not be decoded, and its time
    assert 0 < error.index < 60 and f"frame {error.index} (at about {error.timestamp:.2f} s)" in str(error)
    assert error.timestamp == pytest.approx(error.index / 30)


def test_file_without_video_stream(tmp_path):
    assert "no video stream" in str(_error_for(bad_videos.audio_only(tmp_path)))


def test_cover_art_is_no_video(tmp_path):
    """An MP3 with its album's cover. Before: taken for a video of one frame at 90000 fps. A video file that also
    carries a cover picture is read from its video."""
    from av.stream import Disposition

    assert "no video stream" in str(_error_for(bad_videos.audio_with_cover_art(tmp_path)))
    path = tmp_path / "covered.mp4"
    with av.open(str(path), "w") as container:
        cover = bad_videos.add_cover_art(container)
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        container.mux(cover)
        for index in range(20):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(draw_test_frame(index, (64, 32)), format="rgb24")))
        container.mux(stream.encode())
    with av.open(str(path)) as container:
        assert [bool(stream.disposition & Disposition.attached_pic) for stream in container.streams.video] == [
            False, True]  # (an MP4 lists its cover after its tracks)
    video = open_video(path)
    assert (video.num_frames, video.fps, video.width, video.height) == (20, 10, 64, 32)
    assert [read_frame_index(frame.image) for frame in video.frames()] == list(range(20))


def test_zero_frame_video(tmp_path):
    assert "no frames" in str(_error_for(bad_videos.zero_frames(tmp_path)))
    assert "no frames" in str(_error_for([]))
    assert "no frames" in str(_error_for(np.zeros((0, 8, 8, 3), np.uint8)))


def test_bad_in_memory_sources():
    assert "uint8 [N, H, W, 3]" in str(_error_for(np.zeros((2, 8, 8, 3), np.float32)))
    assert "uint8 [N, H, W, 3]" in str(_error_for(np.zeros((8, 8, 3), np.uint8)))
    assert "PIL images" in str(_error_for([np.zeros((8, 8), np.uint8)]))
    assert "unsupported" in str(_error_for(42))


def test_fps_is_refused_for_a_file(clip):
    assert "fps=" in str(_error_for(clip, fps=2))


# ---------------------------------------------------------------------------------------------------
# Bounded memory
# ---------------------------------------------------------------------------------------------------


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_growth_while_reading(path: Path) -> int:
    """Largest rise of the resident set above its level at the start, while every frame is converted."""
    video = open_video(path)
    gc.collect()
    baseline = peak = _resident_bytes()
    count = 0
    for _ in video.sample(max_fps=video.fps, max_frames=10_000):
        count += 1
        peak = max(peak, _resident_bytes())
    assert count == video.num_frames
    return peak - baseline


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set size from /proc")
def test_memory_does_not_grow_with_video_length(tmp_path):
    # Decoded pixels live in FFmpeg buffers that tracemalloc cannot see, so this watches the resident set.
    # Holding the frames of the long video would take 600 x 48 KiB = 28 MiB (x 1.5 with the YUV frames).
    short = write_test_video(tmp_path / "short.mp4", frames=150, fps=30, size=(128, 128))
    long = write_test_video(tmp_path / "long.mp4", frames=600, fps=30, size=(128, 128))
    _rss_growth_while_reading(short)  # warm up: decoder threads, buffer pools
    growth_short = _rss_growth_while_reading(short)
    growth_long = _rss_growth_while_reading(long)
    assert growth_long < growth_short + 8 * 2**20, (growth_short, growth_long)


def test_at_most_one_decoded_frame_is_alive(tmp_path):
    path = write_test_video(tmp_path / "clip.mp4", frames=60, fps=30, size=(64, 64))
    video = open_video(path)
    for reading in (video.frames(), video.sample(max_fps=30), video.sample_at_rate(10)):
        assert inspect.isgenerator(reading)
        alive: list[weakref.ref] = []
        for frame in reading:
            alive.append(weakref.ref(frame.image))
            del frame  # frames hold no reference cycles: dropping the last reference frees the image
            # At most the current image (the reader may hold it; a repeated index yields the same one again).
            assert len({id(ref()) for ref in alive if ref() is not None}) <= 1
        assert len(alive) >= 20


# ---------------------------------------------------------------------------------------------------
# Preprocessing
# ---------------------------------------------------------------------------------------------------


def _random_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize("size", [448, 112])
def test_internvl_frame_equals_transformers_pil_image_processor(size):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    image = _random_image(37, 90)
    processor = GotOcr2ImageProcessorPil(
        size={"height": size, "width": size}, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD, crop_to_patches=False
    )
    expected = processor(images=Image.fromarray(image), return_tensors="pt")["pixel_values"][0]
    ours = internvl_pixel_values(image, size)
    assert ours.shape == (3, size, size) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(internvl_pixel_values(Image.fromarray(image), size), ours)


SIZES = [(16, 16), (64, 64), (100, 150), (480, 640), (3000, 4000), (40, 400), (1000, 33), (720, 1280)]


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_qwen_frame_size_matches_transformers_video_smart_resize(height, width):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    min_pixels, max_pixels = 128 * 32 * 32, 768 * 32 * 32
    ours = qwen_frame_size(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
    # transformers' budget is over the frames of a temporal patch: two frames hold twice the pixels.
    expected = smart_resize(
        2, height, width, temporal_factor=2, factor=32, min_pixels=2 * min_pixels, max_pixels=2 * max_pixels
    )
    assert ours == expected
    h, w = ours
    assert h % 32 == 0 and w % 32 == 0 and min_pixels <= h * w <= max_pixels
    if min(height, width) >= 64:
        assert abs(np.log((h / w) / (height / width))) < 0.35  # aspect ratio kept (up to rounding)


def _qwen_pil_image_processor(min_pixels: int, max_pixels: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=QWEN_MEAN, image_std=QWEN_STD,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )  # fmt: skip


@pytest.mark.parametrize(("height", "width"), [(100, 150), (480, 640), (64, 64)])
def test_qwen_single_frame_equals_transformers_pil_image_processor(height, width):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    min_pixels, max_pixels = 4 * 32 * 32, 64 * 32 * 32
    image = _random_image(height, width, seed=1)
    target = smart_resize(height, width, factor=32, min_pixels=min_pixels, max_pixels=max_pixels)
    expected = _qwen_pil_image_processor(min_pixels, max_pixels)(images=Image.fromarray(image), return_tensors="pt")
    pixel_values, grid_thw = qwen_pixel_values([image], target)  # a lone frame fills its temporal patch
    assert grid_thw.tolist() == expected["image_grid_thw"].tolist() == [[1, target[0] // 16, target[1] // 16]]
    assert pixel_values.shape == (target[0] * target[1] // 256, 3 * 2 * 16 * 16)
    torch.testing.assert_close(pixel_values, expected["pixel_values"].float(), atol=1e-5, rtol=0)


def test_qwen_two_frames_follow_transformers_video_patch_order():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    size = (96, 128)
    frames = [_random_image(70, 90, seed=2), _random_image(70, 90, seed=3)]
    pixel_values, grid_thw = qwen_pixel_values(frames, size)
    normalized = torch.stack([internvl_pixel_values(f, size, mean=QWEN_MEAN, std=QWEN_STD) for f in frames])
    expected, grid_t, grid_h, grid_w = Qwen3VLVideoProcessor().patchify(
        normalized[None], patch_size=16, merge_size=2, temporal_patch_size=2
    )
    assert grid_thw.tolist() == [[grid_t, grid_h, grid_w]] == [[1, 6, 8]]
    torch.testing.assert_close(pixel_values, expected[0], atol=0, rtol=0)
    # The two frames are distinguishable inside each patch: time is the second axis of (C, T, P, P).
    per_patch = pixel_values.view(-1, 3, 2, 16, 16)
    assert not torch.equal(per_patch[:, :, 0], per_patch[:, :, 1])


def test_qwen_lone_last_frame_is_duplicated_and_bad_sizes_refused():
    image = _random_image(64, 64, seed=4)
    alone, grid = qwen_pixel_values([image], (64, 64))
    paired, _ = qwen_pixel_values([image, image], (64, 64))
    torch.testing.assert_close(alone, paired, atol=0, rtol=0)
    three, grid3 = qwen_pixel_values([image, image, _random_image(64, 64, seed=5)], (64, 64))
    assert grid.tolist() == [[1, 4, 4]] and grid3.tolist() == [[2, 4, 4]] and three.shape[0] == 32
    with pytest.raises(ValueError, match="multiple"):
        qwen_pixel_values([image], (48, 64))


def test_temporal_groups_pad_the_last_group_and_stay_lazy():
    assert list(temporal_groups([1, 2, 3, 4, 5])) == [(1, 2), (3, 4), (5, 5)]
    assert list(temporal_groups([1, 2])) == [(1, 2)]
    assert list(itertools.islice(temporal_groups(itertools.count()), 2)) == [(0, 1), (2, 3)]


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None,
    reason="transformers' video processors need torchvision, which cannot be installed here; "
    "the patch layout is checked against Qwen3VLVideoProcessor.patchify and the PIL image processor instead",
)
def test_qwen_video_equals_transformers_video_processor():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    # Frames already at the target size, so neither side resamples (PIL and torchvision bicubic differ).
    frames = np.stack([_random_image(64, 96, seed=s) for s in range(4)])
    processor = Qwen3VLVideoProcessor(size={"shortest_edge": 64 * 96, "longest_edge": 4 * 64 * 96})
    expected = processor(
        videos=[frames], do_sample_frames=False, cap_pixels_per_frame=False, do_resize=False, return_tensors="pt"
    )
    pixel_values, grid_thw = qwen_pixel_values(list(frames), (64, 96))
    assert grid_thw.tolist() == expected["video_grid_thw"].tolist()
    torch.testing.assert_close(pixel_values, expected["pixel_values_videos"].float(), atol=1e-5, rtol=0)


def test_a_path_with_a_character_a_line_cannot_show_is_named_on_one_line(tmp_path):
    """Before: a newline in a video's path cut the one-line error to the path's first part ("error: no"), the
    problem lost."""
    missing = tmp_path / "no\nsuch.mp4"
    with pytest.raises(VideoNotFoundError) as error:
        open_video(missing)
    assert "\n" not in str(error.value) and str(error.value).endswith("no\\nsuch.mp4: no such file or folder")
    broken = tmp_path / "bad\tname.mp4"
    broken.write_bytes(b"junk")
    with pytest.raises(VideoError) as error:
        open_video(broken)
    assert "\t" not in str(error.value) and "bad\\tname.mp4: not a readable video file" in str(error.value)


def test_a_rate_that_is_not_a_number_or_is_infinite_is_refused_in_one_line(tmp_path):
    """Before: `sample_at_rate(nan)` raised numpy's "cannot convert float NaN to integer", `sample(max_fps=nan)` kept
    every frame, and `open_video(folder, fps=inf)` put every frame at 0 s."""
    video = open_video(np.zeros((4, 8, 8, 3), np.uint8))
    for rate in (float("nan"), float("inf"), 1e308, 0.0):
        with pytest.raises(ValueError, match=r"^fps must be a number above 0 and at most"):
            list(video.sample_at_rate(rate))
    with pytest.raises(ValueError, match="max_fps must be > 0"):
        list(video.sample(max_fps=float("nan")))
    with pytest.raises(VideoError, match="fps must be a number above 0"):
        open_video(np.zeros((4, 8, 8, 3), np.uint8), fps=float("inf"))
