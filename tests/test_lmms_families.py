"""The lmms-eval plugin on the other families: tiny random Qwen3-VL (two frames a step, times in the prompt) and
Eagle2.5 (its own modelling code) checkpoints loaded through ``from_pretrained``, called as lmms-eval calls the
model (chat requests whose ``args`` are ``(context, doc_to_messages, gen_kwargs, doc_id, task, split)``)."""

from __future__ import annotations

import types

import pytest

from statekv.eval.fabricate import write_still_seconds_video
from statekv.eval.lmms_plugin import StateKV

FLAGS = {"batch_size": 1, "max_batch_size": None, "device": None}  # what lmms-eval 0.7.3 passes beside --model_args


def doc_to_messages(doc: dict) -> list[dict]:
    content = [{"type": "video", "url": doc["clip"]}, {"type": "text", "text": doc["question"]}]
    return [{"role": "user", "content": content}]


def answers(model: StateKV, docs: list[dict]) -> list[str]:
    model.task_dict = {"t": {"test": docs}}
    requests = [types.SimpleNamespace(args=("<ctx>", doc_to_messages, {"max_new_tokens": 4}, doc_id, "t", "test"),
                                      metadata={}) for doc_id in range(len(docs))]
    return model.generate_until(requests)


def model_of(tiny_checkpoint, family: str, args: str = "") -> StateKV:
    trust = ",trust_remote_code=true" if family == "eagle" else ""
    return StateKV.create_from_arg_string(f"pretrained={tiny_checkpoint(family)},device=cpu,budget=24{trust}{args}",
                                          FLAGS)


@pytest.mark.parametrize("family", ["qwen3_vl", "eagle"])
def test_a_clip_running_past_its_time_shows_what_a_clip_cut_at_it_shows(family, tiny_checkpoint, tmp_path):
    """Before: a question at second S pushed its clip's frame at S too, which `statekv eval` (frames before S) and a
    clip cut at the time never show, so a clip cut a little late (at a keyframe) changed the answer."""
    model = model_of(tiny_checkpoint, family)
    source = write_still_seconds_video(tmp_path / "source.mp4", 6)
    cut = write_still_seconds_video(tmp_path / "cut.mp4", 3)  # the source's first 3 s: frames 0, 1, 2 at 1 fps
    asked = {"video": "source.mp4", "realtime": 3.0, "question": "What is shown now?"}
    (at_cut,) = answers(model, [{**asked, "clip": str(cut)}])
    (past,) = answers(model, [{**asked, "clip": str(source)}])
    assert past == at_cut


def test_a_disk_tier_stream_leaves_no_files_once_its_questions_are_answered(tiny_checkpoint, tmp_path):
    """Before: each source's stream kept its disk-tier file set (its whole detailed cache) under offload_dir after
    its questions, for a `Stream.load` no run makes: a run over a benchmark filled the disk."""
    offload = tmp_path / "offload"
    model = model_of(tiny_checkpoint, "qwen3_vl", f",offload=disk,offload_dir={offload}")
    clip = write_still_seconds_video(tmp_path / "clip.mp4", 4)
    (answer,) = answers(model, [{"video": "source.mp4", "realtime": 3.5, "question": "What?", "clip": str(clip)}])
    assert isinstance(answer, str) and list(offload.iterdir()) == []
