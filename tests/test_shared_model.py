"""One model shared: streams in several threads, and ordinary calls meanwhile, each get what they get alone.

The language model's attention is switched once per model, and each stream's cache and RoPE rotation are
found through the calling thread, so nothing one stream does is visible to another or to a plain ``generate``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import statekv
from statekv.synthetic.plans import plan_video
from statekv.synthetic.prompts import question_prompt
from statekv.synthetic.scenes import render
from statekv.synthetic.tasks import ask_all
from statekv.testing import make_tiny_checkpoint

THREADS = 8
ROUNDS = 3
FRAMES = 14


def _videos() -> list[tuple[np.ndarray, str]]:
    """``THREADS`` different synthetic videos ``[N, H, W, 3]``, each with one of its questions."""
    videos = []
    for seed in range(THREADS):
        rng = np.random.default_rng(9000 + seed)
        plan = plan_video(rng, FRAMES)
        spec = ask_all(plan, rng)[seed % 6]
        videos.append((np.stack([render(still) for still in plan.stills]), question_prompt(spec.question,
                                                                                           spec.options)))
    return videos


def _encode_and_ask(qa: statekv.VideoQA, frames: np.ndarray, question: str):
    with qa.encode(frames) as video:
        answer = video.ask_tokens(question, max_new_tokens=6)
        carried = [video.prefill.carried(layer)[0].clone() for layer in range(len(video.prefill.cache.layers))]
    return answer, carried


def _same(first, second) -> bool:
    (answer_a, carried_a), (answer_b, carried_b) = first, second
    return torch.equal(answer_a, answer_b) and all(torch.equal(a, b) for a, b in zip(carried_a, carried_b))


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_pretrained("builtin", method="statekv", budget=48)


def test_streams_in_eight_threads_on_one_model_answer_as_they_do_alone(qa):
    videos = _videos()
    alone = [_encode_and_ask(qa, frames, question) for frames, question in videos]
    assert len({tuple(answer.flatten().tolist()) for answer, _ in alone}) > 1  # the videos really differ

    model = qa.adapter.model
    prompt = torch.tensor([[3, 17, 41, 5, 99, 12, 7]])
    plain_alone = model.generate(prompt, max_new_tokens=8, do_sample=False)

    for _ in range(ROUNDS):
        results, errors = [None] * THREADS, []
        start = threading.Barrier(THREADS + 1)

        def run(index: int) -> None:
            try:
                start.wait()
                results[index] = _encode_and_ask(qa, *videos[index])
            except BaseException as error:  # reported below, with the thread's index
                errors.append((index, error))

        threads = [threading.Thread(target=run, args=(index,)) for index in range(THREADS)]
        for thread in threads:
            thread.start()
        start.wait()
        plain = [model.generate(prompt, max_new_tokens=8, do_sample=False) for _ in range(3)]  # meanwhile
        for thread in threads:
            thread.join()
        assert not errors, errors
        for index in range(THREADS):
            assert _same(results[index], alone[index]), f"thread {index} answered differently"
        for output in plain:
            assert torch.equal(output, plain_alone)


def test_streams_with_different_horizons_on_a_dynamic_rope_model_keep_their_own_rotation(tmp_path):
    """Two live streams with different horizons, interleaved frame by frame on one model whose RoPE is dynamic
    (the tiny InternVL's), each answer as they would alone: the frozen rotation belongs to the stream."""
    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "internvl")
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="full")
    rope = qa.adapter.model.get_decoder().rotary_emb
    assert rope.rope_type == "dynamic"
    frames = [np.random.default_rng(seed).integers(0, 255, (112, 112, 3), dtype=np.uint8) for seed in range(6)]
    short, long_ = 6, 600  # horizons in frames: the long one is past the trained length, so NTK rescales
    assert qa.horizon_for(long_) > qa.adapter.model.config.text_config.max_position_embeddings

    def alone(horizon: int) -> torch.Tensor:
        stream = qa.stream(horizon_frames=horizon)
        for frame in frames:
            stream.push(frame)
        return stream.ask_tokens("What is shown?", max_new_tokens=5)

    expected = {horizon: alone(horizon) for horizon in (short, long_)}
    streams = {horizon: qa.stream(horizon_frames=horizon) for horizon in (short, long_)}
    for frame in frames:
        for stream in streams.values():
            stream.push(frame)
    answers = {horizon: stream.ask_tokens("What is shown?", max_new_tokens=5) for horizon, stream in streams.items()}
    for horizon in (short, long_):
        assert torch.equal(answers[horizon], expected[horizon])
    frozen = {horizon: stream.prefill.rope.frequencies(rope) for horizon, stream in streams.items()}
    assert not torch.equal(frozen[short], frozen[long_])  # the two streams really rotate differently
