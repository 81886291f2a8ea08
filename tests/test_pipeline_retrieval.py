"""Answering from retrieved frames through `VideoQA` on every supported family, and ``rekv`` end to end."""

from __future__ import annotations

import pytest
import torch

import statekv
from statekv.testing import make_tiny_checkpoint, write_test_video

QUESTION = "What is shown?"
FAMILIES = {"internvl": {}, "qwen3_vl": {}, "eagle": {"trust_remote_code": True}}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval")
    video = write_test_video(root / "clip.mp4", frames=12, fps=2, size=(64, 48))  # 6 frames at 1 fps
    return {"video": video, **{family: make_tiny_checkpoint(family, root / family) for family in FAMILIES}}


@pytest.fixture(scope="module")
def loaded(files):
    return {family: statekv.VideoQA.from_pretrained(files[family], attention="eager", dtype="float32",
                                                    reserve_tokens=64, **extra) for family, extra in FAMILIES.items()}


def answer(qa, video, **ask):
    with qa.encode(video, max_frames=6) as encoded:
        return encoded.ask_tokens(QUESTION, max_new_tokens=6, **ask), encoded


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["full", "statekv", "recency", "rekv"])
def test_retrieving_every_frame_answers_exactly_as_the_whole_cache(files, loaded, family, method):
    qa = loaded[family].with_options(method=method, budget=24, frames=2)
    with qa.encode(files["video"], max_frames=6) as encoded:
        whole = encoded.ask_tokens(QUESTION, max_new_tokens=6, retrieve=None)
        for frames, rule in ((6, "attention"), (6, "rekv"), (100, "recent")):
            assert torch.equal(encoded.ask_tokens(QUESTION, max_new_tokens=6, retrieve=frames, retrieval=rule), whole)
        # the default: the whole cache, or rekv's own 64 frames
        assert torch.equal(encoded.ask_tokens(QUESTION, max_new_tokens=6), whole)


def test_rekv_keeps_its_cache_in_cpu_memory_and_answers_from_few_frames(files):
    qa = statekv.VideoQA.from_pretrained(files["internvl"], method="rekv", frames=2, sinks=2, retrieve=2,
                                         reserve_tokens=64)  # also: from_pretrained takes every method option
    assert qa.engine.offload and qa.retrieve == 2 and isinstance(qa.policy, statekv.ReKV)
    tokens, encoded = answer(qa, files["video"])
    assert tokens.shape[1] > 0 and encoded.stats.peak_cache_device_bytes > 0
    keep = encoded.prefill.policy.sink_tokens
    assert encoded.retrieval(2) == statekv.Retrieval(2, keep_tokens=keep, rule=statekv.MeanKeyMatch())  # ReKV's rule
    assert qa.retrieval == "rekv"
    assert encoded.retrieval(2, "recent") == statekv.Retrieval(2, keep_tokens=keep, rule=statekv.MostRecent())


@pytest.mark.parametrize("retrieve", [0, -3, 2.5, "4", True])
def test_bad_retrieval_settings_are_one_line_errors(files, loaded, retrieve):
    qa = loaded["internvl"]
    with qa.encode(files["video"], max_frames=2) as encoded:
        with pytest.raises(statekv.ConfigurationError, match="retrieve .* must be a positive integer"):
            encoded.ask(QUESTION, retrieve=retrieve)
    with pytest.raises(statekv.ConfigurationError, match="retrieve must be a positive integer"):
        statekv.VideoQA.from_pretrained(files["internvl"], retrieve=retrieve)


def test_the_rule_is_chosen_on_the_video_qa_and_per_question(files, loaded):
    qa = statekv.VideoQA.from_pretrained(files["internvl"], retrieval="recent", retrieve=2, attention="eager",
                                         dtype="float32", reserve_tokens=64)
    assert (qa.retrieval, qa.options.retrieval_rule) == ("recent", "recent")
    assert loaded["internvl"].retrieval == "attention"  # the default
    with qa.encode(files["video"], max_frames=6) as encoded:
        keep = max(encoded.prefix_tokens, encoded.prefill.policy.sink_tokens)
        assert encoded.retrieval(2) == statekv.Retrieval(2, keep_tokens=keep, rule=statekv.MostRecent())
        recent = encoded.ask_tokens(QUESTION, max_new_tokens=6)
        assert torch.equal(encoded.ask_tokens(QUESTION, max_new_tokens=6, retrieval="recent"), recent)
        with pytest.raises(statekv.ConfigurationError, match="unknown retrieval rule 'nearest'"):
            encoded.ask(QUESTION, retrieval="nearest")
    with pytest.raises(statekv.ConfigurationError, match="unknown retrieval rule"):
        statekv.VideoQA.from_pretrained(files["internvl"], retrieval="nearest")
