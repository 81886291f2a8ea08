"""The streaming protocol (one live stream per video, each question at its time, the cache reused), the offline
one, SimpleStream against the model's own one-shot generate, and the streaming synthetic set."""

from __future__ import annotations

from dataclasses import replace

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import statekv
import statekv.eval as ev
from statekv.cli import main
from statekv.errors import ConfigurationError, InputError, StateKVError
from statekv.eval.answering import Asker, answer_afresh, answer_streamed
from statekv.eval.fabricate import write_still_seconds_video
from statekv.eval.prompts import GenerationSettings
from statekv.eval.questions import Question
from statekv.eval.runner import EvalConfig, check_run_file, run_evaluation
from statekv.eval.sharding import group_by_video
from statekv.synthetic.benchmark import MANIFEST_FILE, STREAMING_FILE, make_benchmark
from statekv.synthetic.plans import plan_video
from statekv.synthetic.seeds import video_rng
from statekv.synthetic.streaming import EARLIEST, GROUPS, PAST_GAP, streaming_rows
from statekv.testing import make_tiny_checkpoint
from statekv.video import internvl_pixel_values
from frames import read_frame_index


# ----------------------------------------------------------------------------- the driver, on a recording stream


class RecordingStream:
    """A stream that records what it is given: pushed frames (the picture each shows) and what it is asked,
    answering "yes" to a proactive poll from ``yes_from`` frames on."""

    def __init__(self, log: list, yes_from: int | None = None):
        self.log, self.yes_from, self.pictures, self.horizon = log, yes_from, [], 100
        self.stats = statekv.EncodingStats()

    @property
    def frames(self) -> int:
        return len(self.pictures)

    def push(self, frame) -> bool:
        self.pictures.append(read_frame_index(frame.image))
        self.stats.frames = len(self.pictures)
        return True

    def flush(self) -> None:
        pass

    def ask(self, prompt: str, **options) -> str:
        self.log.append((prompt, list(self.pictures)))
        if "yes or no" in prompt:
            return "Yes." if self.yes_from is not None and self.frames >= self.yes_from else "No."
        return "It shows 6" if "output" in prompt else "B"

    def watch(self, prompt: str, **options) -> "RecordingWatch":
        return RecordingWatch(self, prompt)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class RecordingWatch:
    """A watch of a `RecordingStream`: each evaluation is logged as an ask, its answer numbered."""

    def __init__(self, stream: RecordingStream, prompt: str):
        self.stream, self.prompt, self.evaluations, self.closed = stream, prompt, 0, False
        self.evaluate()  # opening evaluates

    def evaluate(self) -> str:
        assert not self.closed
        self.evaluations += 1
        self.answer = self.stream.ask(self.prompt)
        self.stream.log.append(("evaluation", self.prompt, self.evaluations))
        return self.answer

    def close(self) -> None:
        self.closed = True
        self.stream.log.append(("closed", self.prompt))


class RecordingQA:
    def __init__(self, yes_from: int | None = None):
        self.log, self.streams, self.yes_from = [], [], yes_from
        self.adapter = None

    def stream(self, horizon_frames, **options):
        self.streams.append(horizon_frames)
        return RecordingStream(self.log, self.yes_from)


def timed(qid: str, second: float | None, video: Path, **fields) -> Question:
    return Question(benchmark=fields.pop("benchmark", "synthetic"), qid=qid, video_id=video.name, video_path=video,
                    question=f"q{qid}", options=("a", "b", "c", "d"), answer="B", task_type="t", realtime=second,
                    **fields)


@pytest.fixture
def video(tmp_path) -> Path:
    return write_still_seconds_video(tmp_path / "v.mp4", 10, offset=0)  # second k shows picture k


def asker(qa) -> Asker:
    asker = Asker(qa, GenerationSettings(max_new_tokens=4), "lmms-eval-0.7")
    asker.room_for = lambda questions: 8  # the recording stream needs no tokenizer
    return asker


def test_one_stream_asks_each_question_at_its_time_having_seen_only_the_frames_before(video):
    qa = RecordingQA()
    questions = [timed("late", 7.2, video), timed("early", 2, video), timed("end", None, video),
                 timed("poll_1", 5, video, item="poll"), timed("poll_0", 3, video, item="poll")]
    answers = list(answer_streamed(asker(qa), group_by_video(questions)[0], max_fps=1))
    assert qa.streams == [11]  # one stream, planned for the video's 10 s
    assert [a.question.qid for a in answers] == ["early", "poll_0", "poll_1", "late", "end"]
    seen = [pictures for _, pictures in qa.log]
    assert seen == [[0, 1], [0, 1, 2], list(range(5)), list(range(8)), list(range(10))]  # ceil(7.2) = 8
    assert [a.info["second"] for a in answers] == [2, 3, 5, 8, None]
    encode = [a.timings["encode"] for a in answers]
    assert encode == sorted(encode)  # one encoding, growing: never re-encoded


def test_forward_polls_are_evaluations_of_one_watch_per_prompt(video):
    """A forward question's polls: its prompt is a watch opened at the first poll (its first evaluation), evaluated
    at each later poll on the frames seen by then, closed after the last; a poll of another prompt (an SSR step)
    is a watch of its own."""
    qa = RecordingQA()
    questions = [timed("count_1", 5, video, item="count", group="forward"),
                 timed("count_0", 3, video, item="count", group="forward"),
                 timed("count_2", 8, video, item="count", group="forward"),
                 timed("step_0", 4, video, item="steps", group="forward"),
                 timed("step_1", 6, video, item="steps", group="forward")]
    questions = [replace(q, question="how many?") if q.item == "count" else q for q in questions]
    answers = list(answer_streamed(asker(qa), group_by_video(questions)[0], max_fps=1))
    assert [a.question.qid for a in answers] == ["count_0", "step_0", "count_1", "step_1", "count_2"]
    evaluations = [entry for entry in qa.log if entry[0] == "evaluation"]
    counted = [entry[2] for entry in evaluations if "how many?" in entry[1]]
    assert counted == [1, 2, 3]  # one watch, evaluated at its three polls
    assert [entry[2] for entry in evaluations if "how many?" not in entry[1]] == [1, 1]  # a step each
    assert [len(entry[1]) for entry in qa.log if len(entry) == 2 and "how many?" in entry[0]] == [3, 5, 8]
    assert sum(entry[0] == "closed" for entry in qa.log) == 3
    assert all(a.info["watch"] and a.info["second"] == a.question.realtime for a in answers)


def test_offline_encodes_afresh_for_each_time(video):
    qa = RecordingQA()
    questions = [timed("a", 2, video), timed("b", 2, video), timed("c", 4, video)]
    answers = list(answer_afresh(asker(qa), group_by_video(questions)[0], max_fps=1))
    assert [a.question.qid for a in answers] == ["a", "b", "c"] and len(qa.streams) == 2
    assert [pictures for _, pictures in qa.log] == [[0, 1], [0, 1], [0, 1, 2, 3]]
    assert {a.info["mode"] for a in answers} == {"afresh"}


@pytest.mark.parametrize(("yes_from", "answered_at", "correct"), [(6, 6, True), (9, 9, False), (None, None, False)])
def test_a_proactive_output_is_polled_every_second_until_the_model_says_its_time(video, yes_from, answered_at,
                                                                                 correct):
    qa = RecordingQA(yes_from)
    proactive = Question(benchmark="streamingbench", qid="p", video_id="v", video_path=video,
                         question='When 6 is shown, output "6".', options=(), answer="6",
                         task_type="Proactive Output", group="contextual", kind="proactive", realtime=2.0,
                         expected_time=6.0)
    (answer,) = answer_streamed(asker(qa), group_by_video([proactive])[0], max_fps=1)
    polls = [entry[1] for entry in qa.log if len(entry) == 2 and "yes or no" in entry[0]]
    assert sum(entry[0] == "closed" for entry in qa.log) == 1  # its poll's watch, closed when polling ended
    last = answered_at if answered_at is not None else 10  # polled until 4 s after the expected time
    assert [len(pictures) for pictures in polls] == list(range(3, last + 1))  # from one second after asking
    assert answer.info["answered_at"] == answered_at and answer.info["polls"] == len(polls)
    assert answer.text == ("It shows 6" if answered_at else "No.")
    assert ev.AnswerRecord.for_answer(proactive, answer.text, model="m", method="m", **answer.info).correct is correct


# ----------------------------------------------------------------------------- SimpleStream


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("internvl"))


def one_shot_answer(adapter, pictures: list[np.ndarray], question: str, new_tokens: int) -> torch.Tensor:
    """The model's own generate over the prompt with these frames and the question, all at once, written by hand
    in the adapter's layout (as tests/test_pipeline.py does)."""
    tokenizer, model = adapter.tokenizer, adapter.model
    block = "<img>" + "<IMG_CONTEXT>" * model.config.image_seq_length + "</img>"
    if adapter.layout == "paper":
        text_turn = [{"role": "user", "content": [{"type": "text", "text": question}]}]
        prompt = f"{block}\n" * len(pictures) + tokenizer.apply_chat_template(
            text_turn, tokenize=False, add_generation_prompt=True)
    else:
        turn = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
        prompt = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        prompt = prompt.replace("<video>", "\n".join(f"Frame{i + 1}: {block}" for i in range(len(pictures))))
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    pixels = torch.stack([internvl_pixel_values(picture, adapter.image_size) for picture in pictures])
    output = model.generate(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                            max_new_tokens=new_tokens, do_sample=False)
    return output[:, ids.shape[1]:]


@pytest.mark.parametrize("layout", ["paper", "chat"])
def test_simplestream_answers_from_the_last_n_frames_exactly_as_the_model_does_on_them_alone(internvl, layout):
    qa = statekv.VideoQA.from_pretrained(internvl, method="simplestream", window=3, attention="eager",
                                         reserve_tokens=40, layout=layout)
    assert qa.options.label == "SimpleStream N=3" and statekv.VideoQA.from_pretrained(
        internvl, method="simplestream").recent_window == 4
    pictures = list(np.random.default_rng(0).integers(0, 256, (7, 40, 60, 3), dtype=np.uint8))
    stream = qa.stream(100, max_fps=1)
    assert isinstance(stream, statekv.RecentFrames)
    for second, picture in enumerate(pictures):
        stream.push(picture, second)
    expected = one_shot_answer(qa.adapter, pictures[-3:], "Why?", 6)
    assert torch.equal(stream.ask_tokens("Why?", max_new_tokens=6), expected)
    assert torch.equal(stream.ask_tokens("Why?", max_new_tokens=6), expected)  # nothing kept between questions
    assert torch.equal(stream.ask_tokens("Why?", max_new_tokens=6, retrieve=None), expected)  # None: all of them
    with pytest.raises(ConfigurationError, match="retrieve=1 is not used by method='simplestream'"):
        stream.ask_tokens("Why?", max_new_tokens=6, retrieve=1)  # retrieving would not be SimpleStream's answer
    assert torch.equal(stream.ask_tokens("Why?", max_new_tokens=6, retrieval="attention"), expected)  # unread
    with pytest.raises(ConfigurationError, match="retrieve=1 is not used by method='simplestream'"):
        stream.watch("Why?", every=1, retrieve=1)
    assert stream.answer_info.frames == 3 and stream.frames == 7 and stream.tokens == 0
    assert stream.held_bytes == 3 * pictures[0].nbytes  # the last frames' pixels, whatever the stream's length
    encoded = qa.encode(np.stack(pictures))  # a stored video: its last 3 sampled frames
    assert torch.equal(encoded.ask_tokens("Why?", max_new_tokens=6), expected)
    other = qa.stream(10)  # pushed beside other streams (statekv serve's worker does): alone, nothing to batch
    assert qa.push_many([(other, pictures[0], 0.0), (other, pictures[1], 1.0)]) == [True, True]
    assert other.frames == 2 and other.pending == []
    with pytest.raises(StateKVError, match="no cache to save"):
        stream.save("s.safetensors")
    with pytest.raises(InputError, match="RGB uint8"):
        stream.push(np.zeros((4, 4), dtype=np.uint8))
    stream.close()
    with pytest.raises(InputError, match="closed"):
        stream.ask("Why?")


# ----------------------------------------------------------------------------- the streaming synthetic set


def test_streaming_questions_have_their_evidence_before_at_or_after_their_time():
    for index in range(40):
        rng = video_rng(11, index)
        plan = plan_video(rng)
        rows = {row["task"]: row for row in streaming_rows(plan, rng, "v.mp4", first_id=5 * index)}
        assert set(rows) == set(GROUPS) and [row["id"] for row in rows.values()] == list(range(5 * index,
                                                                                            5 * index + 5))
        for task, row in rows.items():
            assert set(row) >= {"id", "task", "video", "question", "options"}  # OVO-Bench's fields
            if GROUPS[task] == "backward":
                assert max(row["evidence"]) + PAST_GAP <= row["realtime"] <= plan.num_frames
                assert row["options"][row["gt"]] == row["answer"]
            elif GROUPS[task] == "realtime":  # the evidence is the last frame seen
                assert row["realtime"] == row["evidence"][-1] + 1 and row["realtime"] >= 2
            else:
                colour = row["question"].split()[-1].rstrip("?")
                thing = next(i for i, t in enumerate(plan.things) if t.colour == colour)
                frames = plan.appearances[thing]
                assert row["evidence"] == list(frames) and len(frames) >= 2
                polls = row["test_info"]
                assert [poll["realtime"] for poll in polls] == [frame + 1 for frame in frames]
                assert [row["options"][poll["gt"]] for poll in polls] == [str(n + 1) for n in range(len(frames))]
                assert polls[0]["realtime"] >= min(EARLIEST, frames[0] + 1)  # evidence still to come after it
        single = plan.things[plan.single]
        assert rows["needle_past"]["answer"] == rows["needle_now"]["answer"] == single.colour


def test_synthetic_make_streaming_writes_ovo_format_and_is_refused_with_families(tmp_path, capsys):
    assert main(["synthetic", "make", "--streaming", "--out", str(tmp_path / "s"), "--videos", "2",
                 "--seed", "9"]) == 0
    rows = json.loads((tmp_path / "s" / STREAMING_FILE).read_text())
    assert len(rows) == 10 and json.loads((tmp_path / "s" / MANIFEST_FILE).read_text())["streaming"] is True
    questions = ev.load_benchmark("synthetic", tmp_path / "s")
    assert {q.group for q in questions} == {"backward", "realtime", "forward"}
    assert all(q.item_id == q.qid.split("_")[0] for q in questions)
    assert main(["synthetic", "make", "--streaming", "--families", "needle", "--out", str(tmp_path / "t"),
                 "--videos", "1", "--seed", "9"]) == 2
    assert "--families does not apply to --streaming" in capsys.readouterr().err


@pytest.mark.slow
def test_every_method_answers_the_streaming_set_on_one_stream_per_video(tmp_path, monkeypatch):
    data = tmp_path / "data"
    make_benchmark(data, videos=2, seed=12, streaming=True, num_frames=24)  # short videos: a quick test
    questions = ev.load_benchmark("synthetic", data)
    qa = statekv.VideoQA.from_pretrained("builtin", method="statekv", budget=64)
    streams = []
    real_stream = statekv.VideoQA.stream
    monkeypatch.setattr(statekv.VideoQA, "stream", lambda self, *a, **k: streams.append((self.method, k["name"]))
                        or real_stream(self, *a, **k))
    for method, sizes in (("statekv", {"budget": 64}), ("simplestream", {})):
        summary = run_evaluation(EvalConfig.for_model("synthetic", "builtin", data, tmp_path / method, method=method,
                                                      mode="streaming", progress=False, **sizes),
                                 qa=qa if method == "statekv" else None)
        assert summary["run"]["mode"] == "streaming"
        assert set(summary["score"]["group_scores"]) == {"backward", "realtime", "forward"}
        assert summary["score"]["overall"]["questions"] == 10 and summary["score"]["missing"] == 0
        assert [Path(name).name for m, name in streams if m == method] == ["v0000.mp4", "v0001.mp4"]
        records = ev.run_records(tmp_path / method)
        assert len(records) == len(questions)
        for record in records:
            question = next(q for q in questions if q.qid == record.qid)
            assert record.extra["second"] == math.ceil(question.realtime) and record.extra["mode"] == "stream"
            assert record.extra["frames"] == math.ceil(question.realtime)  # the frames seen so far, one per second
            assert record.extra.get("watch", False) == (question.group == "forward")  # forward polls: a watch
    simple = {r.qid: r for r in ev.run_records(tmp_path / "simplestream")}
    assert all(r.extra["held_bytes"] == min(4, r.extra["frames"]) * 112 * 112 * 3 for r in simple.values())


@pytest.mark.slow
def test_modes_are_checked_and_recorded(tmp_path, capsys):
    data = tmp_path / "data"
    make_benchmark(data, videos=1, seed=13, streaming=True, num_frames=24)
    assert EvalConfig.for_model("synthetic", "builtin", data, tmp_path / "a").mode == "offline"
    assert EvalConfig.for_model("ovobench", "builtin", data, tmp_path / "a").mode == "streaming"
    assert EvalConfig.for_model("ovobench", "builtin", data, tmp_path / "a", ovobench_videos="clips").mode == "offline"
    with pytest.raises(ConfigurationError, match="ovobench_videos=clips contradicts mode=streaming"):
        EvalConfig.for_model("ovobench", "b", data, tmp_path / "a", ovobench_videos="clips", mode="streaming")
    with pytest.raises(ConfigurationError, match="mode must be one of streaming, offline"):
        EvalConfig.for_model("synthetic", "b", data, tmp_path / "a", mode="live")
    with pytest.raises(ConfigurationError, match="synthetic has no groups to choose"):
        EvalConfig.for_model("synthetic", "b", data, tmp_path / "a", groups=("realtime",))
    check_run_file(EvalConfig.for_model("ovobench", "builtin", data, tmp_path / "ovo", mode="offline"), [], write=True)
    with pytest.raises(ConfigurationError, match="holds a run with mode='offline', not 'streaming'; to resume it, "
                                                 "give --mode offline"):  # before: named ovobench_videos, not a flag
        check_run_file(EvalConfig.for_model("ovobench", "builtin", data, tmp_path / "ovo"), [], write=False)
    offline = run_evaluation(EvalConfig.for_model("synthetic", "builtin", data, tmp_path / "run", progress=False))
    assert offline["run"]["mode"] == "offline"
    assert {r.extra["mode"] for r in ev.run_records(tmp_path / "run")} == {"afresh"}
    with pytest.raises(ConfigurationError, match="holds a run with mode='offline', not 'streaming'"):
        run_evaluation(EvalConfig.for_model("synthetic", "builtin", data, tmp_path / "run", mode="streaming",
                                            progress=False))
    capsys.readouterr()
    assert main(["eval", "synthetic", "--mode", "streaming", "--model", "builtin", "--method", "simplestream",
                 "--data-root", str(data), "--out", str(tmp_path / "cli"), "--no-progress", "--max-frames", "5"]) == 0
    assert ("statekv eval: warning: --max-frames 5 does not cap a stream, which reads each question's frames up to "
            "its time\n") in capsys.readouterr().err  # before: ignored unsaid
    assert json.loads((tmp_path / "cli" / "results.json").read_text())["method_label"] == "SimpleStream N=4"
    from statekv.eval.command import uncapped_warning

    sb = {mode: EvalConfig.for_model("streamingbench", "builtin", data, tmp_path / "sb", mode=mode)
          for mode in ("streaming", "offline")}
    assert uncapped_warning(5, sb["offline"]) == ("--max-frames 5 does not cap StreamingBench's offline mode, which "
                                                  "reads each question's frames up to its time")  # before: unsaid
    assert uncapped_warning(5, sb["streaming"]).endswith("does not cap a stream, which reads each question's frames "
                                                         "up to its time")
    assert uncapped_warning(512, sb["offline"]) is None and uncapped_warning(None, sb["offline"]) is None
    assert uncapped_warning(5, EvalConfig.for_model("videomme", "builtin", data, tmp_path / "v")) is None


@pytest.mark.slow
def test_streamingbench_runs_streaming_and_offline(internvl, tmp_path):
    from statekv.eval.fabricate import write_mini_streamingbench

    write_mini_streamingbench(tmp_path / "data")
    qa = statekv.VideoQA.from_pretrained(internvl, method="statekv", budget=32)
    for mode in ("streaming", "offline"):
        summary = run_evaluation(EvalConfig.for_model("streamingbench", str(internvl), tmp_path / "data",
                                                      tmp_path / mode, budget=32, mode=mode, max_new_tokens=3,
                                                      progress=False), qa=qa)
        assert summary["score"]["overall"]["questions"] == 6 and summary["score"]["missing"] == 0
        assert set(summary["score"]["group_scores"]) == {"realtime", "contextual"}
        proactive = next(r for r in ev.run_records(tmp_path / mode) if r.kind == "proactive")
        assert proactive.extra["expected_at"] == 6.0 and 1 <= proactive.extra["polls"] <= 8
        assert proactive.extra["answered_at"] in (None, *range(3, 11))
    streamed = {r.qid: r.extra["frames"] for r in ev.run_records(tmp_path / "streaming") if r.kind == "choice"}
    assert streamed == {"real-0": 2, "real-1": 5, "real-2": 5, "sqa-0": 3, "sqa-1": 7}


def test_a_real_time_ovobench_run_of_an_earlier_statekv_resumes_with_groups_realtime(tmp_path):
    from statekv.eval.runner import RUN_FILE, check_run_file

    earlier = EvalConfig.for_model("ovobench", "m", tmp_path, tmp_path / "run", groups=("realtime",))
    settings = {key: value for key, value in earlier.identity().items() if key not in ("mode", "groups")}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / RUN_FILE).write_text(json.dumps({"settings": settings, "content": {},
                                                          "expected_qids": []}))
    check_run_file(earlier, [], write=False)  # the same run: it read the real-time group, streaming
    with pytest.raises(ConfigurationError, match="holds a run with no groups recorded \\(its run.json predates it: "
                                                 "taken as groups=\\['realtime'\\]\\), not None"):
        check_run_file(EvalConfig.for_model("ovobench", "m", tmp_path, tmp_path / "run"), [], write=False)


@pytest.mark.parametrize("mode", ["streaming", "offline"])
def test_an_evaluation_on_the_disk_tier_leaves_no_file_sets_behind(tmp_path, mode, capsys):
    """Before: every stream an evaluation made (one a video streaming, one a question offline) left its disk-tier
    file set, its whole detailed cache, under --offload-dir; an evaluation never resumes one."""
    data, offload = tmp_path / "data", tmp_path / "offload"
    make_benchmark(data, videos=1, seed=13, streaming=True, num_frames=12)
    assert main(["eval", "synthetic", "--mode", mode, "--model", "builtin", "--data-root", str(data), "--out",
                 str(tmp_path / "run"), "--no-progress", "--offload", "disk", "--offload-dir", str(offload)]) == 0
    assert ev.run_records(tmp_path / "run")
    assert not list(offload.iterdir())
