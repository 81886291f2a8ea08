"""Forward questions answered through watches (`Stream.watch`), as a stream that is told to watch for something
answers: OVO-Bench's forward group, the synthetic set's forward questions and StreamingBench's proactive outputs.

Under ``--mode streaming`` a forward question's polls (one `Question` per poll, sharing its item) are not asked
afresh: the question's prompt becomes a watch on the video's stream when its first poll is due, and each poll is
an evaluation of that watch at its time (the first: the evaluation its opening makes). An evaluation reads the
stream's carried state and the frames since the watch's last evaluation, not the whole detailed cache, and while
it is open the watch steers what the stream carries (`statekv.core.rules.steering`). A poll whose prompt differs (SSR's
steps) is a watch of its own. A watch is closed after the last poll of its prompt. A proactive output's poll ("is it
the right time to output ...?") is a watch evaluated every second of its polls, closed once it says yes.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from statekv.eval.questions import Question


def watched(question: Question) -> bool:
    """Whether ``question`` is answered through a watch under ``--mode streaming``: a forward poll."""
    return question.group == "forward" and question.kind != "proactive"


class VideoWatches:
    """The watches of one video's stream while its questions are asked (`statekv.eval.answering`): opened at a
    prompt's first poll, evaluated at each, closed after its last."""

    def __init__(self, questions: Sequence[Question], prompt_of):
        self.prompt_of = prompt_of
        self.left = Counter((question.item_id, prompt_of(question)) for question in questions if watched(question))
        self.open: dict[tuple[str, str], Any] = {}

    def answer(self, stream: Any, question: Question, max_new_tokens: int) -> tuple[str, float, dict]:
        """``(answer text, seconds, info)`` of ``question``'s poll: an evaluation of its prompt's watch now."""
        key = (question.item_id, self.prompt_of(question))
        text, seconds, info = self.evaluate(stream, key, key[1], max_new_tokens)
        self.left[key] -= 1
        if self.left[key] <= 0:
            self.close(key)
        return text, seconds, info

    def evaluate(self, stream: Any, key: tuple[str, str], prompt: str, max_new_tokens: int) -> tuple[str, float, dict]:
        """Evaluate the watch of ``key`` (opened on ``stream`` with ``prompt`` if it is not open yet: opening
        evaluates it)."""
        started = time.perf_counter()
        watch = self.open.get(key)
        if watch is None:
            watch = self.open[key] = stream.watch(prompt, max_new_tokens=max_new_tokens)
        else:
            watch.evaluate()
        info = {"watch": True, "evaluations": watch.evaluations}
        return watch.answer or "", time.perf_counter() - started, info

    def close(self, key: tuple[str, str]) -> None:
        watch = self.open.pop(key, None)
        if watch is not None:
            watch.close()

    def close_all(self) -> None:
        for key in list(self.open):
            self.close(key)
