"""Hostile settings and lmms-eval requests: each bad value refused in one line of statekv's own errors, early, never
a raw error from deep inside torch or the tokenizer, never silently ignored."""

from __future__ import annotations

import types

import pytest
import torch

import statekv
from statekv.errors import ConfigurationError, InputError
from statekv.eval.lmms_plugin import StateKV, video_and_prompt
from statekv.settings.options import ModelOptions


@pytest.fixture(scope="module")
def simplestream() -> statekv.VideoQA:
    return statekv.VideoQA.from_pretrained("builtin", device="cpu", method="simplestream")


@pytest.mark.parametrize("offload", ["cuda:banana", "mps9", "cuda:", "cuda:٣"])
def test_an_offload_device_torch_cannot_read_is_refused_when_the_options_are_made(offload):
    # it was accepted, then raised torch's "Invalid device string" when the first stream was made
    with pytest.raises(ConfigurationError,
                       match=f"offload must be True, False, 'memory', 'disk' or a device, got '{offload}'"):
        ModelOptions(model="builtin", offload=offload)


@pytest.mark.parametrize("offload", ["cpu", "cpu:0", "cuda", "cuda:1", "mps", "mps:0", torch.device("cpu"),
                                     torch.device("cuda", 1)], ids=str)
def test_offload_device_names_are_still_taken(offload):
    assert ModelOptions(model="builtin", offload=offload).offload == offload


def test_a_setting_takes_the_words_the_command_line_takes_and_no_other_spelling(tmp_path):
    """Before: ``offload="memory"`` (``--offload memory``) was refused in Python, and ``kv_cache_dtype="INT8"``,
    which the command line refuses, was taken."""
    from statekv.cli import main

    assert ModelOptions(model="builtin", offload="memory").engine.offload is True
    with pytest.raises(ConfigurationError, match="kv_cache_dtype must be auto, int8 or int4, got 'INT8'"):
        ModelOptions(model="builtin", kv_cache_dtype="INT8")
    with pytest.raises(SystemExit):
        main(["stream", str(tmp_path / "v.mp4"), "--kv-cache-dtype", "INT8"])


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ({"horizon_frames": -1}, InputError, "horizon_frames must be a positive integer, got -1"),
    ({"horizon_frames": True}, InputError, "horizon_frames must be a positive integer, got True"),
    ({"kv_cache_dtype": "int2"}, ConfigurationError, "kv_cache_dtype must be auto, int8 or int4, got 'int2'"),
    ({"vision_batch": 0}, ConfigurationError, "vision_batch must be a positive integer, got 0"),
    ({"stream_id": ""}, ConfigurationError, "stream_id must be non-empty printable text"),
    ({"owner": 5}, ConfigurationError, "owner must be a non-empty string"),
])
def test_a_simplestream_stream_refuses_bad_arguments_too(simplestream, arguments, error, message):
    with pytest.raises(error, match=message):  # they were ignored, unchecked
        simplestream.stream(**arguments)


def test_a_simplestream_streams_kv_cache_dtype_is_its_questions(simplestream):
    with simplestream.stream(kv_cache_dtype="int8") as stream:  # it was dropped
        assert stream.clip_engine.kv_cache_dtype == "int8"
    with simplestream.stream() as stream:
        assert stream.clip_engine.kv_cache_dtype is None


def test_a_cache_cap_under_simplestream_is_refused_as_unread(tmp_path, capsys):
    # it was taken, and every question then failed on its own window: "the detailed cache is full"
    from statekv.cli import main
    with pytest.raises(ConfigurationError, match="max_cache_bytes=10000 is not used by method='simplestream'"):
        ModelOptions.given(model="builtin", method="simplestream", max_cache_bytes=10**4)
    assert main(["stream", str(tmp_path / "v.mp4"), "--model", "builtin", "--method", "simplestream",
                 "--max-cache-bytes", "10K"]) == 2
    assert "--max-cache-bytes 10240 is not used by --method simplestream" in capsys.readouterr().err


def test_a_simplestream_made_from_a_capped_videoqa_still_answers(simplestream):
    capped = statekv.VideoQA.from_pretrained("builtin", device="cpu", max_cache_bytes=10**4)
    with capped.with_options(method="simplestream").stream() as stream:
        for seconds in range(3):
            stream.push(torch.zeros(32, 32, 3, dtype=torch.uint8).numpy(), float(seconds))
        assert stream.ask("Which?\nA. a\nB. b\nC. c\nD. d\nAnswer with the letter.", max_new_tokens=1)


def test_an_evicting_cap_without_offload_is_refused_before_the_model_loads():
    with pytest.raises(ConfigurationError, match="cache_limit=evict-oldest needs the detailed cache offloaded"):
        ModelOptions.given(model="builtin", max_cache_bytes=10**6, cache_limit="evict-oldest")
    ModelOptions.given(model="builtin", method="rekv", max_cache_bytes=10**6, cache_limit="evict-oldest")


def test_model_options_with_changes_refuses_unknown_names():
    with pytest.raises(ConfigurationError, match="unknown option 'bugdet'; known: model, method, budget"):
        ModelOptions(model="builtin").with_changes(bugdet=3)


@pytest.mark.parametrize(("messages", "message"), [
    (None, "expected chat messages (a list of role and content dicts), got None"),
    ("hello", "expected chat messages (a list of role and content dicts), got 'hello'"),
    (["hello"], "expected chat messages"),
    ([{"role": "user", "content": None}], "a user turn's content must be a list of typed items, got None"),
    ([{"role": "user", "content": ["hi"]}], "a user turn's content must be a list of typed items, got ['hi']"),
    ([{"role": "user", "content": [{"type": "video", "url": "v.mp4"}, {"type": "text", "text": None}]}],
     "a text item's text must be a string, got None"),
    ([{"role": "user", "content": [{"type": "video", "url": "v.mp4"}, {"type": "text", "text": "what\udc80?"}]}],
     "the question text holds a lone surrogate"),
])
def test_malformed_chat_messages_are_one_input_error(messages, message):
    with pytest.raises(InputError) as error:
        video_and_prompt(messages, where="task doc 0")
    assert str(error.value).startswith("task doc 0: ") and message in str(error.value)


def _doc_to_messages(doc):
    return [{"role": "user", "content": [{"type": "video", "url": doc["video"]}, {"type": "text", "text": "q"}]}]


@pytest.mark.parametrize(("args", "message"), [
    (("", _doc_to_messages, {}, 7, "task", "test"), "names doc 7 of task 'task' (split 'test'), which the tasks'"),
    (("", _doc_to_messages, {}, 0, "nope", "test"), "names doc 0 of task 'nope'"),
    (("", _doc_to_messages, [1, 2], 0, "task", "test"), "its gen_kwargs a mapping, got function and list"),
    (("", None, {}, 0, "task", "test"), "doc_to_messages must be callable"),
])
def test_a_request_naming_no_document_or_malformed_ends_the_run_in_one_line(args, message, capsys):
    model = StateKV(qa=types.SimpleNamespace())
    model.task_dict = {"task": {"test": [{"video": "v.mp4"}]}}
    with pytest.raises(SystemExit) as exit_info:
        model.generate_until([types.SimpleNamespace(args=args)])
    assert exit_info.value.code == 2  # it was 1, with a traceback
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1 and "Traceback" not in error


def test_a_max_fps_no_stream_takes_is_refused_as_the_model_loads(capsys):
    with pytest.raises(SystemExit) as exit_info:  # it was refused at the first streaming question
        StateKV(qa=types.SimpleNamespace(), max_fps=1e9)
    assert exit_info.value.code == 2
    assert "max_fps must be at most 4e+07, got 1000000000.0" in capsys.readouterr().err
