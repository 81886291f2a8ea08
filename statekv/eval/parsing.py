"""Turn a model's answer text into an option letter, or ``None`` when no letter can be read.

Two parser generations, selected by name:

``"lmms-eval-0.7"`` (default), for VideoMME and MLVU: lmms-eval 0.7's ranked extractor
(``lmms_eval/tasks/_task_utils/mcq_extract.py``, checked against 0.7.3), which both tasks call with
the choices A-D. The answer is stripped of whitespace, then of leading/trailing ``, . ! ? ; : ' "``
(one character kind after another, in that order) and padded with a space on each side. Every rule
below proposes candidates (a letter and a position); the highest-ranked rule wins, and within it the
largest position::

    10 start        the stripped answer opens with the letter, not followed by a letter: "B", "B) ..."
     9 end          it closes with the letter, not preceded by a letter: "... so it is C"
     7 phrase       for each answer phrase ("the answer is", "i choose", ...) found (its first
                    occurrence, case-insensitive): the first occurrence of each letter after it
     6 "(X)"   5 "X."   4 "X:"   3 "X)"   2 "X "   the last occurrence of each, even inside words
     0 any          only when nothing else matched: the last occurrence of each letter anywhere

Only capital letters count ("I think it's c" -> nothing). The rules' quirks are kept: after "the
answer is" every later letter is a candidate, so "The answer is C because A is wrong" -> "A".

``"paper"``, the parsers of the paper's release era:
  - VideoMME: strip, delete the phrases "The best answer is", "The correct answer is",
    "The answer is", "The answer"; then the first capital A-D anywhere, even inside a word
    ("Based on the video, C" -> "B"); nothing when the rest has more than 10 words and no A-D.
  - MLVU: the character before the first ")", else the whole stripped answer.

The synthetic set (`statekv.synthetic`) reads answers with lmms-eval 0.7's extractor over the question's
letters under both generations.

OVOBench uses neither: it counts an answer correct when the ground-truth letter occurs anywhere
in the stripped answer, in both generations (see ``ovobench_letter``); its forward polls are read as counts or
Yes/No (`statekv.eval.ovobench.judge`). StreamingBench reads the first character of the answer, and a proactive
output by its text and time (`statekv.eval.streamingbench.judge`), in both generations.
"""

from __future__ import annotations

import re

from statekv.eval import ovobench, streamingbench

PARSERS = ("lmms-eval-0.7", "paper")
DEFAULT_PARSER = "lmms-eval-0.7"

PAPER_VIDEOMME_PHRASES = ("The best answer is", "The correct answer is", "The answer is", "The answer")

LMMS_EVAL_CHOICES = "ABCD"  # what lmms-eval 0.7's videomme and mlvu tasks pass to the extractor
# lmms-eval 0.7's answer phrases, matched in the lower-cased answer
ANSWER_PHRASES = (
    "the answer is", "answer is", "the correct answer is", "correct answer is", "the best answer is",
    "best answer is", "the correct option is", "correct option is", "the best option is", "best option is",
    "the choice is", "choice is", "the correct choice is", "correct choice is", "i choose", "i select", "i pick",
    "my answer is", "my choice is", "옵션", "정답은", "답은", "답:", "答案是", "答案为", "选", "答えは",
)
_EDGE_PUNCTUATION = (",", ".", "!", "?", ";", ":", "'", '"')
_MARKED = ((6, "({})"), (5, "{}."), (4, "{}:"), (3, "{})"), (2, "{} "))  # rank, pattern
_RANK_PHRASE, _RANK_START, _RANK_END = 7, 10, 9


def check_parser(parser: str) -> str:
    if parser not in PARSERS:
        raise ValueError(f"unknown parser {parser!r}; expected one of {', '.join(PARSERS)}")
    return parser


def parse_answer(benchmark: str, response: str, parser: str = DEFAULT_PARSER, letters: str = "ABCD") -> str | None:
    """The option letter ``response`` chose under ``parser``, for VideoMME or MLVU.

    ``letters`` are the question's option letters (the paper-era MLVU parser checks against them);
    lmms-eval 0.7 always extracts one of A-D, as its tasks do.
    """
    check_parser(parser)
    if benchmark not in ("videomme", "mlvu"):
        raise ValueError(f"parse_answer handles videomme and mlvu, not {benchmark!r} (see ovobench_letter)")
    if parser == "lmms-eval-0.7":
        return ranked_letter(response, LMMS_EVAL_CHOICES)
    if benchmark == "videomme":
        return paper_videomme_letter(response)
    return paper_mlvu_letter(response, letters)


def ranked_letter(response: str, letters: str = LMMS_EVAL_CHOICES) -> str | None:
    """lmms-eval 0.7's ranked extractor over the choices ``letters`` (see the module docstring)."""
    if not re.fullmatch(r"[A-Z]+", letters):
        raise ValueError(f"letters must be capital A-Z, got {letters!r}")
    text = response.strip()
    if not text:
        return None
    for mark in _EDGE_PUNCTUATION:
        text = text.strip(mark)
    text = f" {text} "
    candidates: list[tuple[int, int, str]] = []  # (rank, position, letter)
    for rank, pattern in _MARKED:
        for letter in letters:
            position = text.rfind(pattern.format(letter))
            if position >= 0:
                candidates.append((rank, position, letter))
    lowered = text.lower()
    for phrase in ANSWER_PHRASES:
        found = lowered.find(phrase)
        if found >= 0:
            for letter in letters:
                position = text.find(letter, found + len(phrase))
                if position >= 0:
                    candidates.append((_RANK_PHRASE, position, letter))
    core = text.strip()
    if core and core[0] in letters and (len(core) == 1 or not core[1].isalpha()):
        candidates.append((_RANK_START, 0, core[0]))
    if core and core[-1] in letters and (len(core) == 1 or not core[-2].isalpha()):
        candidates.append((_RANK_END, len(text) - 1, core[-1]))
    if not candidates:
        candidates = [(0, text.rfind(letter), letter) for letter in letters if letter in text]
    if not candidates:
        return None
    return max(candidates, key=lambda candidate: candidate[:2])[2]


def paper_videomme_letter(response: str) -> str | None:
    text = response.strip()
    for phrase in PAPER_VIDEOMME_PHRASES:
        text = text.replace(phrase, "")
    match = re.search(r"[ABCD]", text)
    if len(text.split()) > 10 and match is None:
        return None
    return match.group(0) if match else None


def paper_mlvu_letter(response: str, letters: str = "ABCD") -> str | None:
    text = response.strip()
    if ")" in text:
        close = text.index(")")
        text = text[close - 1 : close]  # "" when ")" comes first, like the original slice
    return text if len(text) == 1 and text in letters else None


def ovobench_letter(response: str, answer: str, letters: str) -> str | None:
    """OVOBench's substring rule, reported as a letter.

    The answer is correct iff ``answer`` occurs anywhere in the stripped response (so "Based
    on ..." counts as "B"). The letter returned is ``answer`` when it occurs, else the first
    option letter that occurs, else ``None`` (no option letter at all: unparsable).
    """
    text = response.strip()
    if answer in text:
        return answer
    return next((letter for letter in letters if letter in text), None)


def judge(
    benchmark: str, response: str, *, answer: str, letters: str, parser: str = DEFAULT_PARSER, kind: str = "choice",
    answered_at: float | None = None, expected_at: float | None = None,
) -> tuple[str | None, bool]:
    """``(what was read from response (a letter for a choice) or None, whether the answer is correct)`` for any
    benchmark. ``kind``: how the answer is read (`statekv.eval.questions.ANSWER_KINDS`); ``answered_at`` and
    ``expected_at``: when a proactive output was given and was due (seconds)."""
    check_parser(parser)
    if benchmark == "streamingbench":
        return streamingbench.judge(kind, response, answer, letters, answered_at, expected_at)
    if benchmark == "ovobench" and kind != "choice":
        return ovobench.judge(kind, response, answer, letters)
    if benchmark == "ovobench":
        letter = ovobench_letter(response, answer, letters)
    elif benchmark == "synthetic":
        letter = ranked_letter(response, letters)
    else:
        letter = parse_answer(benchmark, response, parser, letters)
    return letter, letter == answer
