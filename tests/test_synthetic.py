"""The synthetic long-video set: plans, question families, files on disk, seeds, `statekv synthetic make`."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from statekv.cli import main
from statekv.errors import ConfigurationError, OutputError
from statekv.eval.loaders import load_benchmark
from statekv.locks import FileLock
from statekv.synthetic.benchmark import MANIFEST_FILE, QUESTIONS_FILE, make_benchmark
from statekv.synthetic.plans import EVENTS_PER_VIDEO, plan_video, quarter_of, quiet_tail
from statekv.synthetic.scenes import COLOURS, EMPTY, SHAPES, Still, render
from statekv.synthetic.seeds import EVALUATION_SEEDS, TRAINING_SEEDS, training_rng, video_rng
from statekv.synthetic.tasks import FAMILIES, QUARTERS, ask_all
from statekv.video import open_video

PLANS = [plan_video(video_rng(7, index)) for index in range(40)]


def test_plans_tell_a_long_story_with_a_quiet_end():
    for plan in PLANS:
        assert plan.num_frames == 96 and quiet_tail(96) == 16
        events = plan.events()
        assert len(events) == EVENTS_PER_VIDEO == 10
        assert len({frame for frame, _ in events}) == 10 and max(frame for frame, _ in events) < 96 - 16
        assert sorted(plan.count(i) for i in range(4)) == [1, 2, 3, 4] and plan.count(plan.single) == 1
        assert [thing.colour for thing in plan.things] == list(COLOURS)  # one object of each colour ...
        assert sorted(thing.shape for thing in plan.things) == sorted(SHAPES)  # ... and of each shape
        for frame, thing in events:  # the stills show exactly the planned objects
            still = plan.stills[frame]
            assert (still.colour, still.shape) == (plan.things[thing].colour, plan.things[thing].shape)
        others = [still for frame, still in enumerate(plan.stills) if frame not in {f for f, _ in events}]
        assert all(still == EMPTY or still.colour == "grey" for still in others)


def test_short_training_videos_show_fewer_objects():
    for frames, objects in ((3, 2), (6, 2), (7, 3), (11, 4), (12, 4)):
        plan = plan_video(training_rng(TRAINING_SEEDS.start, frames), frames)
        assert sorted(plan.count(i) for i in range(len(plan.things))) == list(range(1, objects + 1))
        assert all(len(spec.options) == 4 for spec in ask_all(plan, training_rng(TRAINING_SEEDS.start, 1)))
    with pytest.raises(ValueError, match="at least 3 frames"):
        plan_video(video_rng(0, 0), 2)


def test_every_family_asks_a_four_option_question_whose_evidence_decides_it():
    answers = Counter()
    for index, plan in enumerate(PLANS):
        specs = {spec.family: spec for spec in ask_all(plan, video_rng(7, 1000 + index))}
        assert list(specs) == list(FAMILIES) and len(FAMILIES) >= 6
        for spec in specs.values():
            assert len(spec.options) == 4 and len(set(spec.options)) == 4 and 0 <= spec.answer < 4
            assert spec.evidence and all(frame < 96 - 16 for frame in spec.evidence)  # outside a 16-frame window
            answers[spec.family, spec.answer] += 1
        colour = {thing.colour: i for i, thing in enumerate(plan.things)}
        shape = {thing.shape: i for i, thing in enumerate(plan.things)}
        needle = specs["needle"]  # named by its shape, answered by its colour
        assert needle.options == tuple(COLOURS) and needle.evidence == plan.appearances[plan.single]
        assert plan.things[plan.single].shape in needle.question
        assert plan.things[plan.single].colour == needle.options[needle.answer]
        attribute = specs["attribute"]
        asked = next(c for c in COLOURS if f" {c}?" in attribute.question)
        assert attribute.options == SHAPES and shape[attribute.options[attribute.answer]] == colour[asked]
        count = specs["count"]
        asked = next(c for c in COLOURS if f" {c}?" in count.question)
        assert count.options == ("1", "2", "3", "4") and plan.count(colour[asked]) == count.answer + 1
        assert count.evidence == plan.appearances[colour[asked]]
        order = specs["order"]
        named = [c for c in COLOURS if f" {c}" in order.question]
        assert len(named) == 2 and order.options[order.answer] in named
        assert order.options[order.answer] == min(named, key=lambda c: plan.appearances[colour[c]][0])
        events = plan.events()
        first_last = specs["first_last"]
        frame, thing = events[0] if "first" in first_last.question else events[-1]
        assert first_last.options[first_last.answer] == plan.things[thing].colour and first_last.evidence == (frame,)
        position = specs["position"]
        assert position.options == QUARTERS and quarter_of(position.evidence[0], 96) == position.answer
        assert position.evidence == plan.appearances[plan.single]
    # every letter is the answer to some question of every family (order: the two named colours vary)
    for family in FAMILIES:
        assert all(answers[family, letter] > 0 for letter in range(4)), family


def test_stills_differ_and_seeds_are_split():
    pictures = {render(EMPTY).tobytes()}
    for colour in COLOURS:
        for shape in SHAPES:
            pictures.add(render(Still(colour, shape)).tobytes())
    assert len(pictures) == 1 + len(COLOURS) * len(SHAPES)
    assert EVALUATION_SEEDS.stop <= TRAINING_SEEDS.start
    with pytest.raises(ValueError, match="training range"):
        training_rng(5, 0)
    assert plan_video(video_rng(3, 1)) == plan_video(video_rng(3, 1)) != plan_video(video_rng(3, 2))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic") / "set"
    assert main(["synthetic", "make", "--out", str(out), "--videos", "2", "--seed", "11"]) == 0
    return out


def test_make_writes_decodable_videos_and_a_question_file(made):
    rows = [json.loads(line) for line in (made / QUESTIONS_FILE).read_text().splitlines()]
    assert len(rows) == 2 * len(FAMILIES) and len({row["qid"] for row in rows}) == len(rows)
    assert json.loads((made / MANIFEST_FILE).read_text())["seed"] == 11
    questions = load_benchmark("synthetic", made)
    assert [q.qid for q in questions] == [row["qid"] for row in rows]
    assert {q.task_type for q in questions} == set(FAMILIES) and all(q.letters == "ABCD" for q in questions)
    video = open_video(made / rows[0]["video"])
    assert (video.num_frames, video.fps, video.duration) == (4 * 96, 4.0, 96.0)
    plan = plan_video(video_rng(11, 0))
    frames = list(video.sample(max_fps=1, max_frames=512))  # statekv's default sampling sees every still once
    assert len(frames) == 96 and all(np.array_equal(f.image, render(s)) for f, s in zip(frames, plan.stills))


def test_make_says_how_far_it_is_off_a_terminal(tmp_path, capsys, monkeypatch):
    import statekv.console as console

    monkeypatch.setattr(console, "PROGRESS_SECONDS", 0.0)
    assert main(["synthetic", "make", "--out", str(tmp_path / "s"), "--videos", "3", "--seed", "13",
                 "--frames", "12"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" written")[0] for line in lines] == ["1/3 videos", "2/3 videos"]


def test_a_progress_line_on_a_terminal_is_redrawn_at_most_every_tenth_of_a_second_and_when_done(capsys,
                                                                                                  monkeypatch):
    """A job of many fast steps redraws its line when the terminal can show it, not at every step."""
    import statekv.console as console

    monkeypatch.setattr(console, "interactive", lambda: True)
    line = console.ProgressLine("clip.mp4: ")
    for done in range(1, 1001):
        line(done, 1000, "steps")
    drawn = capsys.readouterr().err
    assert drawn.startswith("\rclip.mp4: 1/1000 steps") and drawn.endswith("\rclip.mp4: 1000/1000 steps\n")
    assert drawn.count("\r") < 100


def test_a_stopped_make_goes_on_where_it_stopped(tmp_path, capsys):
    """Before: a make killed midway left a video cut short under its own name and a folder that a rerun refused as
    "not empty"."""
    clean, stopped = tmp_path / "clean", tmp_path / "stopped"
    make_benchmark(clean, videos=4, seed=13, num_frames=12)

    def stop_after_two(done, total):
        if done == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        make_benchmark(stopped, videos=4, seed=13, num_frames=12, progress=stop_after_two)
    (stopped / "videos" / "v0002.partial.mp4").write_bytes(b"cut short")  # what a kill mid-video leaves
    assert main(["synthetic", "make", "--out", str(stopped), "--videos", "4", "--seed", "14", "--frames", "12"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith('holds a stopped make of another set ({"seed": 13}): run that command again to finish it, '
                          "or pass --overwrite to replace it")
    written = (stopped / "videos" / "v0000.mp4").stat().st_mtime_ns
    assert main(["synthetic", "make", "--out", str(stopped), "--videos", "4", "--seed", "13", "--frames", "12"]) == 0
    assert (stopped / "videos" / "v0000.mp4").stat().st_mtime_ns == written  # made once
    assert sorted(path.name for path in stopped.iterdir()) == sorted(path.name for path in clean.iterdir())
    for name in (QUESTIONS_FILE, "benchmark.json", *(f"videos/v{n:04d}.mp4" for n in range(4))):
        assert (stopped / name).read_bytes() == (clean / name).read_bytes(), name


def test_make_is_deterministic_and_guards_its_folder(made, tmp_path, capsys):
    again = tmp_path / "again"
    make_benchmark(again, videos=2, seed=11)
    assert (again / QUESTIONS_FILE).read_text() == (made / QUESTIONS_FILE).read_text()

    assert main(["synthetic", "make", "--out", str(again), "--videos", "1", "--seed", "12"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "not empty" in error and "--overwrite" in error
    written = (again / "videos" / "v0000.mp4").stat().st_mtime_ns  # the same make run again: done already
    assert make_benchmark(again, videos=2, seed=11) == again / QUESTIONS_FILE  # before: "not empty", exit 2
    assert main(["synthetic", "make", "--out", str(again), "--videos", "2", "--seed", "11"]) == 0
    assert capsys.readouterr().out.startswith(f"{again} holds this set already (a make of it finished); nothing "
                                              "written")
    assert (again / "videos" / "v0000.mp4").stat().st_mtime_ns == written
    writing = FileLock.acquire(again, what="a make")  # another make replacing it: not taken for the finished set
    try:
        with pytest.raises(OutputError, match="another make is writing it"):
            make_benchmark(again, videos=2, seed=11)
    finally:
        writing.release()
    (again / "videos" / "v0001.mp4").unlink()  # no longer whole: refused as a folder holding something else
    assert main(["synthetic", "make", "--out", str(again), "--videos", "2", "--seed", "11"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["synthetic", "make", "--out", str(again), "--videos", "1", "--seed", "12", "--overwrite"]) == 0
    assert len(load_benchmark("synthetic", again)) == len(FAMILIES)
    assert sorted(p.name for p in (again / "videos").iterdir()) == ["v0000.mp4"]
    for foreign in (again / "videos" / "holiday.mp4", again / "notes.txt"):  # a user's own file is never removed
        foreign.write_bytes(b"mine")
        capsys.readouterr()
        assert main(["synthetic", "make", "--out", str(again), "--videos", "1", "--seed", "12", "--overwrite"]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and "which no synthetic set writes" in error, error
        assert foreign.read_bytes() == b"mine" and (again / "videos" / "v0000.mp4").is_file()
        foreign.unlink()
    for cut_short in ("benchmark.json.partial", QUESTIONS_FILE + ".tmp"):  # a write a kill cut short: the set's own
        (again / cut_short).write_bytes(b"{")
        assert main(["synthetic", "make", "--out", str(again), "--videos", "1", "--seed", "12", "--overwrite"]) == 0
        assert not (again / cut_short).exists()

    capsys.readouterr()
    assert main(["synthetic", "make", "--out", str(tmp_path / "t"), "--videos", "1", "--seed", "1000000"]) == 2
    assert "reserved for training" in capsys.readouterr().err
    with pytest.raises(ConfigurationError, match="family"):
        make_benchmark(tmp_path / "f", videos=1, seed=1, families=("needle", "nonsense"))
