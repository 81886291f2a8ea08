"""The lmms-eval plugin used as a researcher runs it for hours: model args mistyped on lmms-eval's command line, a
damaged video in a task, a streaming document with a query time no stream can reach.

Each test calls the model as lmms-eval calls it (``StateKV.create_from_arg_string(text, flags)``, chat requests
whose ``args`` are ``(context, doc_to_messages, gen_kwargs, doc_id, task, split)``), in process: the behaviour is
the plugin's own, and lmms-eval adds nothing to it.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from bad_videos import cut_after_header, not_a_video
from statekv.api.videoqa import VideoQA
from statekv.eval.fabricate import write_lmms_task
from statekv.eval.lmms_plugin import StateKV
from statekv.testing import make_tiny_checkpoint

# what lmms-eval 0.7.3 passes beside --model_args: its --batch_size (default 1), --max_batch_size, --device
FLAGS = {"batch_size": 1, "max_batch_size": None, "device": None}


@pytest.fixture(scope="module")
def qa(tmp_path_factory) -> VideoQA:
    return VideoQA.from_pretrained(make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("internvl")),
                                   method="statekv", budget=32)


def doc_to_messages(doc: dict) -> list[dict]:
    content = [{"type": "video", "url": doc["clip"]}, {"type": "text", "text": doc["question"]}]
    return [{"role": "user", "content": content}]


def requests_for(docs: list[dict], task: str = "t") -> list:
    gen_kwargs = {"max_new_tokens": 3, "until": ["\n\n"]}
    return [types.SimpleNamespace(args=("<ctx>", doc_to_messages, dict(gen_kwargs), doc_id, task, "test"), metadata={})
            for doc_id in range(len(docs))]


def answers_of(qa: VideoQA, docs: list[dict]) -> list[str]:
    model = StateKV(qa=qa)
    model.task_dict = {"t": {"test": docs}}
    return model.generate_until(requests_for(docs))


def one_error_line(capsys) -> str:
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error, error
    return error


# -- --model_args as lmms-eval hands them over ------------------------------------------------------------------


@pytest.mark.parametrize(("text", "flags", "message"), [
    # before: lmms-eval's own split failed with a traceback ("not enough values to unpack") and exited 0
    ("pretrained=m,budget4096", FLAGS, "--model_args: 'budget4096' is not key=value"),
    # before: the last of the two was used, silently
    ("pretrained=m,budget=32,budget=64", FLAGS, "--model_args gives budget twice (budget=32 and budget=64)"),
    # before: the empty value was read as not given (the default budget), silently
    ("pretrained=m,budget=", FLAGS, "--model_args gives budget no value"),
    # before: TypeError "got multiple values for keyword argument 'device'", a traceback and exit status 0
    ("pretrained=m,device=cpu", {**FLAGS, "device": "cuda:1"},
     "--model_args gives device=cpu, but lmms-eval's --device is cuda:1 (as given, or its default)"),
])
def test_malformed_model_args_text_ends_the_run_with_one_line(text, flags, message, monkeypatch, capsys):
    monkeypatch.setattr(VideoQA, "from_options", lambda options: pytest.fail("loaded despite bad model args"))
    with pytest.raises(SystemExit) as exit_info:
        StateKV.create_from_arg_string(text, flags)
    assert exit_info.value.code == 2
    assert message in one_error_line(capsys)


def test_model_args_lmms_eval_also_passes_as_flags_are_taken_once(qa, monkeypatch):
    """lmms-eval always passes --batch_size (1 unless given), so batch_size=1 in --model_args, or the same device
    in both, is the same setting said twice. Before: a TypeError traceback, and exit status 0."""
    loads = []
    monkeypatch.setattr(VideoQA, "from_options", lambda options: loads.append(options) or qa)
    model = StateKV.create_from_arg_string("pretrained=m, budget=64 ,batch_size=1,device=cpu,max_fps=0.5,",
                                           {**FLAGS, "device": "cpu"})
    assert (loads[-1].model, loads[-1].budget, loads[-1].device, model.max_fps) == ("m", 64, "cpu", 0.5)
    StateKV.create_from_arg_string("pretrained=m,batch_size=01", FLAGS)  # before: refused, as text "01" is not "1"


# -- a video that cannot be read -------------------------------------------------------------------------------


def task_with_a_damaged_video(folder: Path, damage) -> list[dict]:
    """`write_lmms_task`'s documents (two videos, two questions each), the second video replaced by ``damage``'s."""
    task = write_lmms_task(folder / "task", videos=2)
    docs = [json.loads(line) for line in (task.parent / "docs.jsonl").read_text().splitlines()]
    damaged = damage(folder)
    return [{**doc, "clip": str(damaged) if doc["video"] == docs[-1]["video"] else doc["video"]} for doc in docs]


@pytest.mark.parametrize("damage", [not_a_video, cut_after_header])
def test_an_unreadable_video_gets_empty_answers_and_the_run_goes_on(damage, qa, tmp_path, capsys):
    """Before: the first damaged video ended the whole run (exit status 2), losing every answer lmms-eval had not
    yet been handed: all of them. Now its questions are answered empty (lmms-eval's --use_cache keeps no empty
    answer, so a rerun asks only them again), one line names it, and the other videos are answered."""
    docs = task_with_a_damaged_video(tmp_path, damage)
    answers = answers_of(qa, docs)
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "statekv (lmms-eval model)" in line]
    assert "cannot read a video: " in line and docs[2]["clip"] in line and "2 questions answered empty" in line
    assert answers[2:] == ["", ""]
    assert answers[:2] == answers_of(qa, docs[:2])  # as if the damaged video were not in the task


def test_an_unreadable_clip_of_a_stream_empties_only_that_streams_later_answers(qa, tmp_path, capsys):
    """A streaming document (a source ``video`` and a ``realtime``) is asked on its source's stream, fed from its
    clip: a clip that cannot be read leaves that stream's later questions empty, and the other sources answered."""
    good = write_lmms_task(tmp_path / "task", videos=1)
    clip = json.loads((good.parent / "docs.jsonl").read_text().splitlines()[0])["video"]
    broken = not_a_video(tmp_path)
    docs = [{"video": "source-a", "realtime": 3, "clip": clip, "question": "Q1?"},
            {"video": "source-b", "realtime": 3, "clip": clip, "question": "Q2?"},
            {"video": "source-b", "realtime": 4, "clip": str(broken), "question": "Q3?"},
            {"video": "source-b", "realtime": 5, "clip": clip, "question": "Q4?"}]
    answers = answers_of(qa, docs)
    error = capsys.readouterr().err
    assert answers[2:] == ["", ""]
    assert answers[:2] == answers_of(qa, [{**doc, "clip": clip} for doc in docs])[:2]  # as if the clip were sound
    assert "cannot read a video on the stream of source-b" in error and str(broken) in error
    assert "2 questions answered empty" in error


# -- a streaming document's query time ---------------------------------------------------------------------------


@pytest.mark.parametrize(("realtime", "shown"), [(1e300, "1e+300"), (float("inf"), "inf"), (-1, "-1"),
                                                 ("00:05", "'00:05'")])
def test_a_streaming_documents_bad_realtime_is_named_in_one_line(realtime, shown, qa, monkeypatch, capsys):
    """Before: 1e300 ended the run with "horizon_frames must be at most 281,474,976,710,656, got 1000000...", a
    setting the user never gave, naming no document; inf, -1 and a text were not streamed at all but answered from
    the clip alone, silently. Now each is refused as `statekv eval ovobench` refuses it, naming the document."""
    monkeypatch.setattr(qa, "stream", lambda *args, **kwargs: pytest.fail("streamed"))
    monkeypatch.setattr(qa, "encode", lambda *args, **kwargs: pytest.fail("answered from the clip alone"))
    model = StateKV(qa=qa)
    model.task_dict = {"t": {"test": [{"video": "source", "realtime": realtime, "clip": "/v.mp4", "question": "Q?"}]}}
    with pytest.raises(SystemExit) as exit_info:
        model.generate_until(requests_for(model.task_dict["t"]["test"]))
    assert exit_info.value.code == 2
    assert one_error_line(capsys).strip() == ("statekv (lmms-eval model): error while answering: t doc 0: field "
                                              f"'realtime' must be a number of seconds from 0 to 1e+11, got {shown}")


def test_an_unreadable_clip_of_a_multi_round_document_empties_only_that_round(qa, tmp_path, capsys):
    """A multi-round document without query times has each round answered from its own clip: a clip that cannot
    be read leaves that round empty, the others answered. Before: the run ended (exit status 2)."""
    task = write_lmms_task(tmp_path / "task", videos=1)
    clip = json.loads((task.parent / "docs.jsonl").read_text().splitlines()[0])["video"]
    clips = [clip, str(not_a_video(tmp_path)), clip]

    def rounds(doc, round_idx=None, previous_output=None, previous_round_info=None):
        index = round_idx or 0
        if index == len(clips):
            return (None, True, previous_output, None)
        messages = doc_to_messages({"clip": clips[index], "question": f"Round {index}?"})
        return messages if round_idx is None else (messages, False, previous_output, None)

    model = StateKV(qa=qa)
    model.task_dict = {"t": {"test": [{"question": "unused"}]}}
    request = types.SimpleNamespace(args=("<ctx>", rounds, {"max_new_tokens": 3}, 0, "t", "test"), metadata={})
    (answers,) = model.generate_until_multi_round([request])
    assert answers[1] == "" and len(answers) == 3
    assert "cannot read a video: " in one_error_line(capsys)


# -- a source's stream: what each of its questions is shown and how its forward rounds are answered ---------------


def _forward(tmp_path):
    """The mini OVO-Bench's first forward document and the lmms-eval multi-round protocol over its clips."""
    from statekv.eval.fabricate import write_mini_ovobench

    root = write_mini_ovobench(tmp_path / "data")
    forward = next(row for row in json.loads((root / "ovo_bench_new.json").read_text()) if "test_info" in row)

    def rounds(doc, round_idx=None, previous_output=None, previous_round_info=None):
        index = round_idx or 0
        if index == len(doc["test_info"]):
            return (None, True, previous_output, None)
        messages = doc_to_messages({"clip": str(root / "chunked_videos" / f"{doc['clip']}_{index}.mp4"),
                                    "question": doc["question"]})
        return messages if round_idx is None else (messages, False, previous_output, None)

    doc = {"video": forward["video"], "clip": forward["id"], "test_info": forward["test_info"],
           "question": "Is there a red square now? Answer yes or no."}
    return root, forward, doc, rounds


def test_a_streamed_forward_round_is_cut_at_the_requests_stops_and_refuses_what_a_watch_cannot_apply(
        tmp_path, capsys):
    """Before: the rounds of a forward document on its source's stream, each its watch's evaluation, kept every word
    after the request's ``until`` (lmms-eval's ovo_forward stops at a blank line, and its REC scorer reads every
    digit of the answer), and num_beams or sampling, which a watch cannot apply, were dropped without a word."""
    _, _, doc, rounds = _forward(tmp_path)
    model = StateKV.create_from_arg_string("pretrained=builtin,device=cpu,budget=4", FLAGS)
    model.task_dict = {"fwd": {"test": [doc]}}

    def asked(gen_kwargs):
        request = types.SimpleNamespace(args=("", rounds, gen_kwargs, 0, "fwd", "test"), metadata={},
                                        request_type="generate_until_multi_round")
        return model.generate_until_multi_round([request])[0]

    whole = asked({"max_new_tokens": 24})
    assert any("red" in answer for answer in whole), whole
    assert asked({"max_new_tokens": 24, "until": ["red"]}) == [answer.split("red")[0] for answer in whole]
    capsys.readouterr()
    for refused in ({"num_beams": 4}, {"temperature": 0.7}, {"repetition_penalty": 1.3}):
        with pytest.raises(SystemExit) as exit_info:
            asked({"max_new_tokens": 8, **refused})
        assert exit_info.value.code == 2 and next(iter(refused)) in one_error_line(capsys)


def test_a_question_on_a_stream_sees_its_clip_up_to_its_time_only(tmp_path):
    """Before: a question's whole clip was pushed, so a clip running past its time showed it later frames, and as
    its source's last question it ended the run ("declared for 2 frames"), naming no document."""
    root, forward, _, _ = _forward(tmp_path)
    model = StateKV.create_from_arg_string("pretrained=builtin,device=cpu", FLAGS)
    longest = max((root / "chunked_videos").glob("*.mp4"), key=lambda path: path.stat().st_size)
    docs = [{"video": forward["video"], "realtime": 1.0, "clip": str(longest), "question": "What shape is shown?"}]
    model.task_dict = {"t": {"test": docs}}
    (answer,) = model.generate_until(requests_for(docs))
    assert answer.strip()


@pytest.mark.parametrize("realtime", [-1, "00:05"])
def test_a_bad_realtime_of_a_document_not_asked_leaves_the_run_alone(realtime, qa, tmp_path):
    """Before: a document of the task about the same source but not asked (another rank's, past a --limit) ended the
    run in one line naming it, while its stream was being planned; now it is refused only where it is asked."""
    root, forward, _, _ = _forward(tmp_path)
    clip = str(root / "chunked_videos" / f"{forward['id']}_1.mp4")
    docs = [{"video": forward["video"], "realtime": 1.0, "clip": clip, "question": "What shape is shown?"},
            {"video": forward["video"], "realtime": realtime, "clip": clip, "question": "What colour is it?"}]
    model = StateKV(qa=qa)
    model.task_dict = {"t": {"test": docs}}
    (answer,) = model.generate_until(requests_for(docs)[:1])
    assert isinstance(answer, str)


def test_a_forward_documents_answers_do_not_depend_on_the_other_forward_documents_asked(tmp_path):
    """Before: the forward documents of one source shared its stream, each one's watch steering what it carried for
    all of them, so a document's answers depended on which others a process held (its rank's share, a --limit).
    Each is now answered on a stream of its own, as if asked alone."""
    _, _, doc, rounds = _forward(tmp_path)
    model = StateKV.create_from_arg_string("pretrained=builtin,device=cpu,budget=4", FLAGS)
    questions = ["Is there a red square now? Answer yes or no.", "What colour is the background? Answer briefly.",
                 "Is a blue circle moving now? Answer yes or no."]
    model.task_dict = {"fwd": {"test": [{**doc, "question": question} for question in questions]}}

    def asked(doc_ids):
        requests = [types.SimpleNamespace(args=("", rounds, {"max_new_tokens": 12}, doc_id, "fwd", "test"),
                                          metadata={}, request_type="generate_until_multi_round")
                    for doc_id in doc_ids]
        return model.generate_until_multi_round(requests)

    alone = [asked([doc_id])[0] for doc_id in range(len(questions))]
    assert asked(range(len(questions))) == alone
    assert asked([2, 0]) == [alone[2], alone[0]]
