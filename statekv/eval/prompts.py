"""The exact lmms-eval prompts and generation settings for each benchmark.

Two protocols exist. ``"lmms-eval-0.7"`` (the default) is lmms-eval 0.7.x. ``"paper"`` is the
paper's released code, which covers VideoMME only: the same instruction without the 0.7
post-prompt, and up to 1024 new tokens. For MLVU and OVOBench both protocols are lmms-eval's (OVO-Bench's
own prompts, `statekv.eval.ovobench`); StreamingBench's are its release's (`statekv.eval.streamingbench`) and
the synthetic set (`statekv.synthetic`) has one protocol of its own, under both names.
The strings below are load-bearing, quirks included: VideoMME's instruction mentions "the
subtitles" in the no-subtitle setting, MLVU's prompt ends on an open parenthesis, OVOBench's
has a space before a newline.
"""

from __future__ import annotations

from dataclasses import dataclass

from statekv.eval import ovobench, streamingbench
from statekv.eval.questions import Question
from statekv.synthetic.prompts import question_prompt

PROTOCOLS = ("lmms-eval-0.7", "paper")
DEFAULT_PROTOCOL = "lmms-eval-0.7"

VIDEOMME_INSTRUCTION = (
    "Select the best answer to the following multiple-choice question based on the video and the subtitles. "
    "Respond with only the letter (A, B, C, or D) of the correct option."
)
VIDEOMME_POST_PROMPT = "\nAnswer with the option's letter from the given choices directly."
MLVU_POST_PROMPT = "\nOnly give the best option.\nBest option: ("
OVOBENCH_TEMPLATE = ovobench.CHOICE_TEMPLATE


@dataclass(frozen=True)
class GenerationSettings:
    """Decoding settings: always greedy; generation ends at ``max_new_tokens`` or at the first
    occurrence of any stop string (the text before it is the answer)."""

    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    do_sample: bool = False

    def cut(self, text: str) -> str:
        """``text`` up to the first stop string (generate() keeps the stop string itself)."""
        ends = [text.find(stop) for stop in self.stop_strings if stop in text]
        return text[: min(ends)] if ends else text


_GENERATION = {
    ("videomme", "lmms-eval-0.7"): GenerationSettings(max_new_tokens=16, stop_strings=("\n\n",)),
    ("videomme", "paper"): GenerationSettings(max_new_tokens=1024, stop_strings=("\n\n",)),
    ("mlvu", "lmms-eval-0.7"): GenerationSettings(max_new_tokens=16, stop_strings=("\n\n",)),
    ("mlvu", "paper"): GenerationSettings(max_new_tokens=16, stop_strings=("\n\n",)),
    ("ovobench", "lmms-eval-0.7"): GenerationSettings(max_new_tokens=128),
    ("ovobench", "paper"): GenerationSettings(max_new_tokens=128),
    # its release lets each model decide; the answer is read from its first character (a proactive output: a
    # short text), so a few tokens are enough
    ("streamingbench", "lmms-eval-0.7"): GenerationSettings(max_new_tokens=32),
    ("streamingbench", "paper"): GenerationSettings(max_new_tokens=32),
    # statekv's own set: one letter is asked for; a few tokens leave room for a real model's "B." or "(B)"
    ("synthetic", "lmms-eval-0.7"): GenerationSettings(max_new_tokens=8),
    ("synthetic", "paper"): GenerationSettings(max_new_tokens=8),
}


def check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}")
    return protocol


def generation_settings(benchmark: str, protocol: str = DEFAULT_PROTOCOL) -> GenerationSettings:
    check_protocol(protocol)
    try:
        return _GENERATION[benchmark, protocol]
    except KeyError:
        raise ValueError(f"unknown benchmark {benchmark!r}") from None


def build_prompt(question: Question, protocol: str = DEFAULT_PROTOCOL) -> str:
    """The text that follows the video in the user turn."""
    check_protocol(protocol)
    if question.benchmark == "videomme":
        prompt = VIDEOMME_INSTRUCTION + "\n" + question.question + "\n" + "\n".join(question.options)
        return prompt + "\n" + VIDEOMME_POST_PROMPT if protocol == "lmms-eval-0.7" else prompt
    if question.benchmark == "mlvu":
        return question.question + MLVU_POST_PROMPT
    if question.benchmark == "ovobench":
        return ovobench.prompt(question)
    if question.benchmark == "streamingbench":
        return streamingbench.prompt(question)
    if question.benchmark == "synthetic":
        return question_prompt(question.question, question.options)
    raise ValueError(f"unknown benchmark {question.benchmark!r}")
