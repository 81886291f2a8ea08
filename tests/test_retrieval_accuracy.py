"""A fast regression of the default retrieval rule on a small held-out synthetic set with the built-in model:
answering from 16 of 96 frames per layer finds the questions' evidence at every layer and keeps the answers.
(The full measurement, with intervals, is benchmarks/retrieval.py -> docs/retrieval.md.)"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

import statekv
from statekv.cli import main
from statekv.eval.loaders import load_synthetic
from statekv.eval.parsing import judge
from statekv.eval.prompts import build_prompt, generation_settings

SEED = 777  # an evaluation seed no rule was tuned on
VIDEOS = 2


@dataclass(frozen=True)
class Recorded(statekv.Retrieval):
    chosen: list = field(default_factory=list, compare=False)

    def choose(self, seen):
        steps = super().choose(seen)
        self.chosen.append(steps)
        return steps


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    folder = tmp_path_factory.mktemp("heldout") / "set"
    assert main(["synthetic", "make", "--out", str(folder), "--videos", str(VIDEOS), "--seed", str(SEED)]) == 0
    return folder


def test_sixteen_retrieved_frames_hold_the_evidence_and_keep_the_answers(heldout):
    qa = statekv.VideoQA.from_pretrained("builtin", method="full")
    settings = generation_settings("synthetic")
    evidence = {row["qid"]: row["evidence_frames"]
                for row in map(json.loads, (heldout / "questions.jsonl").read_text().splitlines())}
    questions = load_synthetic(heldout)
    correct = {"whole": 0, "retrieved": 0}
    for video in sorted({q.video_id for q in questions}):
        asked = [q for q in questions if q.video_id == video]
        with qa.encode(str(asked[0].video_path), reserve_tokens=160) as encoded:
            assert encoded.frames == 96
            for question in asked:
                prompt = build_prompt(question)
                whole = encoded.ask(prompt, max_new_tokens=settings.max_new_tokens, retrieve=None)
                base = encoded.retrieval(16)
                recorded = Recorded(base.steps, base.keep_tokens, base.rule)
                original, encoded.retrieval = encoded.retrieval, lambda *_: recorded
                try:
                    retrieved = encoded.ask(prompt, max_new_tokens=settings.max_new_tokens)
                finally:
                    encoded.retrieval = original
                for name, text in (("whole", whole), ("retrieved", retrieved)):
                    correct[name] += judge("synthetic", settings.cut(text), answer=question.answer,
                                           letters=question.letters)[1]
                steps = {1 + frame for frame in evidence[question.qid]}  # step 0 is the prompt prefix
                assert len(recorded.chosen) == 4  # the built-in model's layers
                for layer, chosen in enumerate(recorded.chosen):
                    assert len(chosen) == 16
                    assert steps & set(chosen), f"{question.qid}: no evidence frame retrieved at layer {layer}"
    assert correct["retrieved"] >= correct["whole"] - 1, correct
