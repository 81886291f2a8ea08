"""The lmms-eval plugin: lmms-eval 0.7's chat request contract, with and without lmms-eval installed.

Requests are built the way lmms-eval 0.7 builds them for a chat model (``Instance.args = (context,
doc_to_messages, gen_kwargs, doc_id, task, split)``, the messages as ``ConfigurableMessagesTask``'s
automatic ``doc_to_messages`` writes them: the video path, then the prompt text).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

import statekv.eval as ev
from statekv.errors import InputError
from statekv.eval import lmms_plugin
from statekv.eval.fabricate import write_lmms_task, write_mini_ovobench, write_mini_videomme
from statekv.eval.lmms_plugin import PADDING_KEY, StateKV, video_and_prompt
from statekv.eval.runner import EvalConfig, run_evaluation
from statekv.settings.options import ModelOptions
from statekv.api.videoqa import VideoQA
from statekv.testing import make_tiny_checkpoint

# lmms-eval 0.7's videomme task: its generation_kwargs, plus the default stop string it adds
VIDEOMME_GEN_KWARGS = {"max_new_tokens": 16, "temperature": 0, "top_p": 1.0, "num_beams": 1, "do_sample": False,
                       "until": ["\n\n"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("internvl"))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("benchmarks")
    write_mini_videomme(root)
    return root


@pytest.fixture(scope="module")
def qa(checkpoint) -> VideoQA:
    return VideoQA.from_pretrained(checkpoint, method="statekv", budget=32)


def doc_to_messages(doc: dict) -> list[dict]:
    content = [{"type": "video", "url": doc["video"]}, {"type": "text", "text": doc["text"]}]
    return [{"role": "user", "content": content}]


def chat_requests(questions, gen_kwargs=VIDEOMME_GEN_KWARGS, make=None):
    """``(requests, task_dict)`` for ``questions`` as lmms-eval hands them to a chat model."""
    docs = [{"video": str(q.video_path), "text": ev.build_prompt(q)} for q in questions]
    make = make or (lambda arguments, doc_id: types.SimpleNamespace(args=arguments))
    requests = [make(("<context>", doc_to_messages, dict(gen_kwargs), doc_id, "videomme", "test"), doc_id)
                for doc_id in range(len(docs))]
    return requests, {"videomme": {"test": docs}}


def test_answers_equal_the_statekv_eval_runner_and_share_one_encoding_per_video(checkpoint, data_root, qa, tmp_path,
                                                                                monkeypatch):
    run_evaluation(EvalConfig.for_model("videomme", str(checkpoint), data_root, tmp_path / "run", budget=32, limit=4,
                              max_new_tokens=4, progress=False), qa=qa)
    expected = {r.qid: r.prediction for r in ev.run_records(tmp_path / "run")}
    questions = ev.load_benchmark("videomme", data_root)[:4]
    order = [questions[i] for i in (0, 3, 1, 2)]  # the two videos interleaved
    requests, task_dict = chat_requests(order, {**VIDEOMME_GEN_KWARGS, "max_new_tokens": 4})
    model = StateKV(pretrained=str(checkpoint), qa=qa)
    model.task_dict = task_dict
    encodes = []
    real_encode = qa.encode
    monkeypatch.setattr(qa, "encode", lambda *a, **k: encodes.append(a[0]) or real_encode(*a, **k))
    answers = model.generate_until(requests)
    assert answers == [expected[q.qid] for q in order]
    assert sorted(encodes) == sorted({str(q.video_path) for q in questions})  # each video once
    assert model.is_simple is False and (model.rank, model.world_size) == (0, 1)


class RecordingVideo:
    """Stands in for an encoded video: returns ``reply`` and records what ``ask`` was given."""

    def __init__(self, reply: str):
        self.reply, self.calls = reply, []

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return None

    def ask(self, prompt, **options):
        self.calls.append((prompt, options))
        return self.reply


def test_generation_kwargs_map_to_ask(checkpoint, qa, monkeypatch):
    model = StateKV(pretrained=str(checkpoint), qa=qa)
    model.task_dict = {"t": {"test": [{"video": "/v.mp4", "text": "Q?"}]}}
    video = RecordingVideo("B. A car passes.\n\nBecause")
    monkeypatch.setattr(qa, "encode", lambda *args, **kwargs: video)

    def answer(gen_kwargs):
        request = types.SimpleNamespace(args=("<ctx>", doc_to_messages, gen_kwargs, 0, "t", "test"))
        return model.generate_until([request])

    assert answer(VIDEOMME_GEN_KWARGS) == ["B. A car passes."]
    prompt, options = video.calls[-1]
    assert prompt == "Q?" and options["max_new_tokens"] == 16 and options["stop_strings"] == ["\n\n"]
    assert "do_sample" not in options and options["tokenizer"] is qa.adapter.tokenizer
    assert answer({"until": "car", "temperature": 0.7, "top_p": 0.9}) == ["B. A "]
    assert video.calls[-1][1] == {"max_new_tokens": lmms_plugin.DEFAULT_MAX_NEW_TOKENS, "do_sample": True,
                                  "temperature": 0.7, "top_p": 0.9, "stop_strings": ["car"],
                                  "tokenizer": qa.adapter.tokenizer}
    assert answer({"max_new_tokens": 128}) == [video.reply]
    assert video.calls[-1][1] == {"max_new_tokens": 128}
    # do_sample as transformers reads it: false is greedy at any temperature, true samples at 1 unless told
    answer({"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "do_sample": False, "num_beams": 1})
    assert video.calls[-1][1] == {"max_new_tokens": 8}
    answer({"max_new_tokens": 8, "do_sample": True})
    assert video.calls[-1][1] == {"max_new_tokens": 8, "do_sample": True, "temperature": 1.0}
    assert len(video.calls) == 5


def test_other_generation_settings_reach_generate_and_keys_none_reads_are_named_once(checkpoint, qa, monkeypatch,
                                                                                     capsys):
    """Before: every key but the six read was dropped without a word (repetition_penalty, top_k, a misspelt
    max_new_tokenz), so a task's settings changed nothing and a typo went unseen."""
    model = StateKV(pretrained=str(checkpoint), qa=qa)
    model.task_dict = {"t": {"test": [{"video": "/v.mp4", "text": "Q?"}]}}
    video = RecordingVideo("B")
    monkeypatch.setattr(qa, "encode", lambda *args, **kwargs: video)

    def answer(gen_kwargs):
        return model.generate_until([types.SimpleNamespace(args=("<ctx>", doc_to_messages, gen_kwargs, 0, "t",
                                                                 "test"))])

    answer({"max_new_tokens": 8, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "top_k": 5})
    assert video.calls[-1][1] == {"max_new_tokens": 8, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2}
    answer({"max_new_tokens": 8, "stop_strings": ["\n"], "until": "."})  # transformers' stop_strings, as until
    assert video.calls[-1][1] == {"max_new_tokens": 8, "stop_strings": [".", "\n"], "tokenizer": qa.adapter.tokenizer}
    answer({"max_new_tokens": 8, "temperature": 0.5, "top_k": 5, "min_new_tokens": 2})  # top_k: only when sampled
    assert video.calls[-1][1] == {"max_new_tokens": 8, "do_sample": True, "temperature": 0.5, "top_k": 5,
                                  "min_new_tokens": 2}
    assert "generation kwargs" not in capsys.readouterr().err
    for _ in range(3):  # lmms-eval's visual_cot and another model's image_aspect_ratio, and a misspelling
        answer({"max_new_tokenz": 1, "visual_cot": False, "image_aspect_ratio": "pad", "use_cache": True})
        assert video.calls[-1][1] == {"max_new_tokens": lmms_plugin.DEFAULT_MAX_NEW_TOKENS}
    said = [line for line in capsys.readouterr().err.splitlines() if "generation kwargs" in line]
    assert len(said) == 1 and "generation kwargs image_aspect_ratio, max_new_tokenz, use_cache, visual_cot are " \
        "not generation settings statekv applies" in said[0], said


def test_messages_must_hold_one_video_and_text():
    video = {"type": "video", "url": "/v.mp4"}
    text = {"type": "text", "text": "Which? "}
    system = {"role": "system", "content": [{"type": "text", "text": "You are helpful."}]}
    assert video_and_prompt([system, {"role": "user", "content": [video, text, {"type": "text", "text": "A or B"}]}]) \
        == ("/v.mp4", "Which? A or B")
    with pytest.raises(InputError, match="exactly one video"):
        video_and_prompt([{"role": "user", "content": [video, video, text]}])
    with pytest.raises(InputError, match="exactly one video"):
        video_and_prompt([{"role": "user", "content": [text]}])
    with pytest.raises(InputError, match="not 'image' content"):
        video_and_prompt([{"role": "user", "content": [{"type": "image", "url": "x.png"}, text]}])
    with pytest.raises(InputError, match="no question text"):
        video_and_prompt([{"role": "user", "content": [video]}])


@pytest.mark.parametrize("answer", ["generate_until", "generate_until_multi_round"])
@pytest.mark.parametrize("args", [("ctx", {"until": []}), None])  # an older request shape, or none
def test_a_request_that_is_not_a_chat_request_ends_the_run_with_one_line(answer, args, qa, capsys):
    model = StateKV(qa=qa)
    with pytest.raises(SystemExit) as exit_info:
        getattr(model, answer)([types.SimpleNamespace(args=args)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "expected a chat request" in error and error.count("\n") == 1 and "Traceback" not in error


def test_model_args_as_lmms_eval_passes_them(checkpoint, monkeypatch):
    # lmms-eval parses --model_args strings: true/false become bools, digits ints, "None", "no", "off" stay strings
    model = StateKV(pretrained=str(checkpoint), method="recency", frames=2, max_num_frames=8, max_fps=1,
                    layout="None", attention="auto", dtype="float32", device="cpu", batch_size="1", max_batch_size=None,
                    trust_remote_code="no", offload="OFF")
    assert model.qa.method == "recency" and model.qa.policy.frames == 2 and model.qa.adapter.layout == "paper"
    assert (model.max_num_frames, model.max_fps) == (8, 1.0) and model.qa.engine.offload is False
    loads = []
    monkeypatch.setattr(VideoQA, "from_options", lambda options: loads.append(options) or "qa")
    StateKV(pretrained="m", trust_remote_code="Yes", offload=1, budget="64", max_fps="0.5", retrieve="8")
    assert loads[-1] == ModelOptions(model="m", budget=64, trust_remote_code=True, offload=True, retrieve=8,
                                     device=loads[-1].device)


@pytest.mark.parametrize(("model_args", "message"), [
    ({"trust_remote_code": "nein"}, "trust_remote_code must be a boolean (true/false, 1/0, yes/no, on/off), got 'nein'"),
    ({"offload": 2}, "offload must be disk, memory, a boolean (on: CPU memory) or none, got 2"),
    ({"offload": "maybe"}, "offload must be disk, memory, a boolean (on: CPU memory) or none, got 'maybe'"),
    ({"budget": 0}, "budget must be at least 1, got 0"),
    ({"budget": "4k"}, "budget must be an integer, got '4k'"),
    ({"max_fps": "fast"}, "max_fps must be a number"),
    ({"method": "fulll"}, "method must be one of statekv, full, recency, rekv, keynorm, simplestream, got 'fulll'"),
    ({"bugdet": 64}, "unknown statekv model arg bugdet; known: pretrained, method, budget, frames,"),
    # before: accepted and replaced by the room each video's requests need, so it changed nothing
    ({"reserve_tokens": 1}, "reserve_tokens is not a statekv model arg: the room after each video is sized from"),
    ({"batch_size": 2}, "answers one request at a time; use --batch_size 1, not 2"),
    ({"pretrained": "None"}, "the statekv model needs pretrained=<checkpoint folder or hub id>"),
])
def test_bad_model_args_end_the_run_with_one_line(model_args, message, monkeypatch, capsys):
    monkeypatch.setattr(VideoQA, "from_pretrained", lambda path, **kwargs: pytest.fail("loaded despite bad args"))
    with pytest.raises(SystemExit) as exit_info:
        StateKV(**{"pretrained": "m", **model_args})
    assert exit_info.value.code == 2  # lmms-eval would log an exception and exit 0
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1 and "Traceback" not in error


def test_rank_world_size_and_device_come_from_the_launcher(checkpoint, qa, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    model = StateKV(qa=qa)
    assert (model.rank, model.world_size, model.device) == (3, 4, torch.device("cpu"))
    assert model.tokenizer is qa.adapter.tokenizer
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    loads = []
    monkeypatch.setattr(VideoQA, "from_options", lambda options: loads.append(options) or qa)

    def device(**model_args):
        StateKV(pretrained="m", **model_args)
        return loads[-1].device

    assert [device(device=name) for name in (None, "cuda", "cpu", "cuda:0")] == ["cuda:1", "cuda:1", "cpu", "cuda:0"]
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name)
    assert device() is None and device(device="cuda") == "cuda"  # one process: VideoQA's own default
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(SystemExit):
        StateKV(qa=qa)


def test_ranks_answer_their_share_exactly_as_one_process_would(qa, tmp_path, monkeypatch):
    """lmms-eval deals every world_size-th document to a rank, so a video's questions (here of different
    lengths) land on different ranks; each rank must still plan the video's encoding as one process does."""
    # the tiny InternVL has dynamic RoPE, so the planned horizon changes its answers
    task_file = write_lmms_task(tmp_path, videos=2)
    docs = [json.loads(line) for line in (task_file.parent / "docs.jsonl").read_text().splitlines()]
    task_dict = {"smoke": {"test": [{"video": d["video"], "text": d["question"]} for d in docs]}}
    gen_kwargs = {"max_new_tokens": 4, "until": ["\n\n"]}

    def requests_of(doc_ids, pad=0):
        made = [types.SimpleNamespace(args=("<ctx>", doc_to_messages, dict(gen_kwargs), i, "smoke", "test"),
                                      metadata={}) for i in doc_ids]
        padding = [types.SimpleNamespace(args=made[-1].args, metadata={PADDING_KEY: True}) for _ in range(pad)]
        return made + padding

    model = StateKV(qa=qa)
    model.task_dict = task_dict
    single = model.generate_until(requests_of(range(len(docs))))
    encodes = []
    real_encode = qa.encode
    monkeypatch.setattr(qa, "encode", lambda *a, **k: encodes.append(a[0]) or real_encode(*a, **k))
    shares = {}
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        ranked = StateKV(qa=qa)
        ranked.task_dict = task_dict
        mine = range(rank, len(docs), 2)
        answers = ranked.generate_until(requests_of(mine, pad=rank))  # rank 1 gets one padding request
        assert answers[len(mine):] == [""] * rank
        shares.update(zip(mine, answers))
    assert [shares[i] for i in range(len(docs))] == single
    assert len(encodes) == 2 * len({d["video"] for d in docs})  # each rank encodes each of its videos once


def test_errors_while_answering_end_the_process(qa, capsys, monkeypatch):
    model = StateKV(qa=qa)
    model.task_dict = {"t": {"test": [{"video": "/no/such/video.mp4", "text": "Q?"}]}}
    request = types.SimpleNamespace(args=("<ctx>", doc_to_messages, {}, 0, "t", "test"), metadata={})
    with pytest.raises(SystemExit) as exit_info:
        model.generate_until([request])
    assert exit_info.value.code == 2 and "error while answering" in capsys.readouterr().err
    monkeypatch.setattr(qa, "encode", lambda *a, **k: 1 / 0)
    model.task_dict = {"t": {"test": [{"video": "/v.mp4", "text": "Q?"}]}}
    with pytest.raises(SystemExit) as exit_info:
        model.generate_until([request])
    error = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" in error and "ZeroDivisionError" in error
    with pytest.raises(SystemExit):
        model.loglikelihood([request])


@pytest.mark.parametrize("video", [["/a.mp4", "/b.mp4"], None, 7])
def test_a_document_the_tasks_own_code_cannot_make_messages_of_ends_the_run_with_one_line(video, qa, capsys):
    """lmms-eval's own user turn, built from a document whose video is a list, null or a number. Before: its
    TypeError (or an IndexError) ended the run with a traceback and exit status 1."""
    task = pytest.importorskip("lmms_eval.api.task", reason="lmms-eval is an optional extra")

    def messages(doc):
        return task.ConfigurableMessagesTask._build_user_turn([doc["video"]], doc["text"])

    model = StateKV(qa=qa)
    model.task_dict = {"t": {"test": [{"video": video, "text": "Q?"}]}}
    with pytest.raises(SystemExit) as exit_info:
        model.generate_until([types.SimpleNamespace(args=("<ctx>", messages, {}, 0, "t", "test"), metadata={})])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in error, error
    assert "t doc 0: the task cannot make its chat messages (TypeError: Unsupported visual type" in error


@pytest.mark.parametrize("gen_kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be a whole number of tokens, 1 or more; got 0"),
    ({"max_new_tokens": "abc"}, "max_new_tokens must be a whole number"),
    ({"max_new_tokens": 2.9}, "max_new_tokens must be a whole number"),
    ({"max_new_tokens": 10**400}, "max_new_tokens must be at most 281,474,976,710,656; got 1000"),  # no float holds it
    ({"temperature": "abc"}, "temperature must be a number, 0 or more"),
    ({"temperature": 10**400}, "temperature must be a number, 0 or more; got 1000"),
    ({"temperature": 0.5, "top_p": 0}, "top_p must be a number in (0, 1]"),
    ({"until": [1, 2]}, "until must be a string or a list of strings"),
    ({"num_beams": 4}, "num_beams must be 1 (statekv decodes one sequence, greedy or sampled); got 4"),
    ({"do_sample": "yes"}, "do_sample must be true or false; got 'yes'"),
])
def test_malformed_generation_kwargs_end_the_run_with_one_line(gen_kwargs, message, qa, monkeypatch, capsys):
    """Before: 0 answer tokens read as the default 1024, 2.9 as 2, and the others ended with a traceback."""
    model = StateKV(qa=qa)
    model.task_dict = {"t": {"test": [{"video": "/v.mp4", "text": "Q?"}]}}
    monkeypatch.setattr(qa, "encode", lambda *args, **kwargs: RecordingVideo("B"))
    request = types.SimpleNamespace(args=("<ctx>", doc_to_messages, gen_kwargs, 0, "t", "test"), metadata={})
    with pytest.raises(SystemExit) as exit_info:
        model.generate_until([request])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in error and "Traceback" not in error, error
    assert len([line for line in error.splitlines() if "statekv (lmms-eval model)" in line]) == 1, error


def test_documents_not_asked_are_not_read_to_their_end(qa, monkeypatch):
    """lmms-eval's --limit asks some of a task's documents, and a video may be missing for one not asked (its
    videomme task exits then, its ovobench task asserts): the documents asked are answered. Before: the run ended
    on a document nobody asked."""
    model = StateKV(qa=qa)
    model.task_dict = {"t": {"test": [{"video": "/v.mp4", "text": "Q?"}, {"video": "/gone.mp4", "text": "Q?"},
                                      {"video": "/also-gone.mp4", "text": "Q?"}]}}
    monkeypatch.setattr(qa, "encode", lambda *args, **kwargs: RecordingVideo("B"))

    def missing(doc):
        if doc["video"] == "/gone.mp4":
            sys.exit(f"video path:{doc['video']} does not exist, please check")
        assert doc["video"] != "/also-gone.mp4", "missing clip"
        return doc_to_messages(doc)

    request = types.SimpleNamespace(args=("<ctx>", missing, {}, 0, "t", "test"), metadata={})
    assert model.generate_until([request]) == ["B"]


def test_registered_and_run_through_lmms_eval_itself(checkpoint, data_root, qa):
    pytest.importorskip("lmms_eval.api.model", reason="lmms-eval is an optional extra")
    from lmms_eval.api.instance import Instance
    from lmms_eval.api.model import lmms
    from lmms_eval.models.registry_v2 import ModelRegistryV2

    assert lmms_plugin.LMMS_EVAL_AVAILABLE and issubclass(StateKV, lmms)
    registry = ModelRegistryV2()
    registry.register_manifest(lmms_plugin.manifest())
    assert registry.get_model_class("statekv") is StateKV  # resolved as a chat model (is_simple False)

    model = StateKV.create_from_arg_string(f"pretrained={checkpoint},method=statekv,budget=32,max_fps=1",
                                           {"batch_size": 1, "max_batch_size": None, "device": "cpu"})
    questions = ev.load_benchmark("videomme", data_root)[:2]
    requests, model.task_dict = chat_requests(questions, make=lambda arguments, doc_id: Instance(
        request_type="generate_until", arguments=arguments, idx=0,
        metadata={"task": "videomme", "doc_id": doc_id, "repeats": 1}))
    answers = model.generate_until(requests)
    model.qa = qa  # the same weights, set up like the runner's
    assert answers == model.generate_until(requests) and all(isinstance(a, str) for a in answers)


# -- streaming benchmarks: lmms-eval's ovo_* tasks -------------------------------------------------------------


@pytest.fixture(scope="module")
def steady_checkpoint(tmp_path_factory) -> Path:
    """A tiny InternVL whose RoPE does not depend on the planned length (max_position 8192), so a stream planned
    for one task's questions answers as one planned for all of a video's."""
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("steady"),
                                text_config={"max_position_embeddings": 8192})


def ovo_requests(folder: Path) -> tuple[list, list, dict]:
    """lmms-eval's ``ovo_realtime`` (single round) and ``ovo_forward`` (multi-round) chat requests on the mini
    OVO-Bench, the messages as lmms-eval's automatic ``doc_to_messages`` builds them from the task's functions
    (the clip of the question, or of round ``i``: ``<id>_<i>.mp4``; OVO-Bench's prompts)."""
    rows = json.loads((folder / "ovo_bench_new.json").read_text())
    questions = {q.qid: q for q in ev.load_benchmark("ovobench", folder.parent)}
    realtime = [row for row in rows if row["task"] in ev.OVOBENCH_REALTIME_TASKS]
    forward = [row for row in rows if "test_info" in row]

    def turn(clip: str, text: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "video", "url": str(folder / "chunked_videos" / clip)},
                                             {"type": "text", "text": text}]}]

    def single(doc):
        return turn(f"{doc['id']}.mp4", ev.build_prompt(questions[str(doc["id"])]))

    def rounds(doc, round_idx=None, previous_output=None, previous_round_info=None):
        index = round_idx or 0
        if index == len(doc["test_info"]):
            return (None, True, previous_output, None)
        messages = turn(f"{doc['id']}_{index}.mp4", ev.build_prompt(questions[f"{doc['id']}_{index}"]))
        return messages if round_idx is None else (messages, False, previous_output, None)

    gen_kwargs = {"max_new_tokens": 4, "temperature": 0, "do_sample": False}
    single_requests = [types.SimpleNamespace(args=("", single, dict(gen_kwargs), i, "ovo_realtime", "test"),
                                             request_type="generate_until") for i in range(len(realtime))]
    multi_requests = [types.SimpleNamespace(args=("", rounds, dict(gen_kwargs), i, "ovo_forward", "test"),
                                            request_type="generate_until_multi_round") for i in range(len(forward))]
    return single_requests, multi_requests, {"ovo_realtime": {"test": realtime}, "ovo_forward": {"test": forward}}


def test_ovo_tasks_are_asked_on_one_stream_per_source_video_as_statekv_eval_streams(steady_checkpoint, tmp_path,
                                                                                     monkeypatch):
    root = tmp_path / "data"
    folder = write_mini_ovobench(root)
    qa = VideoQA.from_pretrained(steady_checkpoint, method="statekv", budget=32)
    run_evaluation(EvalConfig.for_model("ovobench", str(steady_checkpoint), root, tmp_path / "run", budget=32,
                                        max_new_tokens=4, progress=False, groups=("realtime", "forward")), qa=qa)
    expected = {r.qid: r.prediction for r in ev.run_records(tmp_path / "run")}
    single, multi, task_dict = ovo_requests(folder)
    model = StateKV(pretrained=str(steady_checkpoint), qa=qa)
    model.task_dict = task_dict
    streams, encodes = [], []
    real_stream = qa.stream
    monkeypatch.setattr(qa, "stream", lambda *a, **k: streams.append(k["name"]) or real_stream(*a, **k))
    monkeypatch.setattr(qa, "encode", lambda *a, **k: encodes.append(a[0]))
    answers = model.generate_until(single)
    docs = task_dict["ovo_realtime"]["test"]
    assert answers == [expected[str(doc["id"])] for doc in docs]
    assert sorted(streams) == ["Fabricated/source0.mp4", "Fabricated/source1.mp4"] and encodes == []
    rounds = model.generate_until_multi_round(multi)
    assert rounds == [[expected["2_0"], expected["2_1"]]]  # round order, though asked at 3 s before 5.5 s
    assert streams[2:] == ["Fabricated/source0.mp4"] and encodes == []


def test_multi_round_tasks_must_follow_the_round_protocol(checkpoint, qa, tmp_path, capsys):
    folder = write_mini_ovobench(tmp_path / "data")
    _, multi, task_dict = ovo_requests(folder)
    model = StateKV(pretrained=str(checkpoint), qa=qa)
    model.task_dict = task_dict
    broken = types.SimpleNamespace(args=("", lambda doc, **rounds: ovo_requests(folder)[0][0].args[1](
        task_dict["ovo_realtime"]["test"][0]), {}, 0, "ovo_forward", "test"))
    with pytest.raises(SystemExit) as exit_info:
        model.generate_until_multi_round([broken])
    assert exit_info.value.code == 2
    assert "round 1 of a multi-round task must give (messages, terminal, output, info)" in capsys.readouterr().err


def test_an_ovo_document_statekv_eval_refuses_stops_the_run_in_one_line(checkpoint, qa, tmp_path, capsys):
    """The plugin reads OVO-Bench documents with statekv eval's loader: a negative query time is refused, not
    answered from its clip as if it were any document."""
    folder = write_mini_ovobench(tmp_path / "data")
    single, _, task_dict = ovo_requests(folder)
    task_dict["ovo_realtime"]["test"][1]["realtime"] = -1
    model = StateKV(pretrained=str(checkpoint), qa=qa)
    model.task_dict = task_dict
    with pytest.raises(SystemExit) as exit_info:
        model.generate_until(single)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == ("statekv (lmms-eval model): error while answering: ovo_realtime doc 1: "
                                               "field 'realtime' must be a number of seconds from 0 to 1e+11, got -1")


@pytest.mark.parametrize("multi_round", [False, True])
def test_a_missing_ovo_clip_ends_the_run_in_one_line_naming_it(multi_round, checkpoint, qa, tmp_path, capsys):
    """lmms-eval's ovobench task asserts that a document's clip exists. Before: that bare AssertionError ended the
    run with a traceback (exit status 1)."""
    utils = pytest.importorskip("lmms_eval.tasks.ovobench.utils")
    folder = write_mini_ovobench(tmp_path / "data")
    single, multi, task_dict = ovo_requests(folder)
    clips = {"data_dir": str(folder / "chunked_videos")}

    def lmms_evals(doc, round_idx=None, **rest):  # the clip as lmms-eval's own task code finds it
        asked = {**clips, "round_idx": round_idx or 0} if multi_round else clips
        turn = [{"role": "user", "content": [{"type": "video", "url": utils.ovo_doc_to_visual(doc, asked)[0]},
                                             {"type": "text", "text": "Q?"}]}]
        return turn if round_idx is None else (turn, round_idx == len(doc["test_info"]), None, None)

    request = (multi if multi_round else single)[0]
    request.args = (*request.args[:1], lmms_evals, *request.args[2:])
    doc = task_dict["ovo_forward" if multi_round else "ovo_realtime"]["test"][0]
    missing = folder / "chunked_videos" / (f"{doc['id']}_1.mp4" if multi_round else f"{doc['id']}.mp4")
    missing.unlink()
    model = StateKV(pretrained=str(checkpoint), qa=qa)
    model.task_dict = task_dict
    with pytest.raises(SystemExit) as exit_info:
        (model.generate_until_multi_round if multi_round else model.generate_until)([request])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in error, error
    (line,) = [line for line in error.splitlines() if line.startswith("statekv")]
    assert str(missing) in line and "missing" in line, line
