"""Turn a model's answer text into an option letter, or ``None`` when no letter can be read.

Two parser generations, selected by name:

``"lmms-eval-0.7"`` (default), for VideoMME and MLVU: a ranked extractor. Only capital option
letters count. Candidates are found by the rules below; the highest-ranked rule that finds one
decides, and among several finds of that rule the last one wins::

    1 start    the answer opens with the letter, alone or marked: "B", "B.", "(B) ...", "B: ..."
    2 end      the answer closes with a stand-alone letter: "... so the answer is C."
    3 phrase   after "answer", "option" or "choice" (+ "is"/":"): "The correct option is (D) ..."
    4 "(X)"    5 "X."    6 "X:"    7 "X)"    8 "X "  anywhere
    9 any      a stand-alone letter anywhere (not a letter inside a word)

``"paper"``, the parsers of the paper's release era:
  - VideoMME: strip, delete the phrases "The best answer is", "The correct answer is",
    "The answer is", "The answer"; then the first capital A-D anywhere, even inside a word
    ("Based on the video, C" -> "B"); nothing when the rest has more than 10 words and no A-D.
  - MLVU: the character before the first ")", else the whole stripped answer.

OVOBench uses neither: it counts an answer correct when the ground-truth letter occurs anywhere
in the stripped answer, in both generations (see ``ovobench_letter``).
"""

from __future__ import annotations

import re
from functools import lru_cache

PARSERS = ("lmms-eval-0.7", "paper")
DEFAULT_PARSER = "lmms-eval-0.7"

PAPER_VIDEOMME_PHRASES = ("The best answer is", "The correct answer is", "The answer is", "The answer")


def check_parser(parser: str) -> str:
    if parser not in PARSERS:
        raise ValueError(f"unknown parser {parser!r}; expected one of {', '.join(PARSERS)}")
    return parser


def parse_answer(benchmark: str, response: str, parser: str = DEFAULT_PARSER, letters: str = "ABCD") -> str | None:
    """The option letter ``response`` chose under ``parser``, for VideoMME or MLVU."""
    check_parser(parser)
    if benchmark not in ("videomme", "mlvu"):
        raise ValueError(f"parse_answer handles videomme and mlvu, not {benchmark!r} (see ovobench_letter)")
    if parser == "lmms-eval-0.7":
        return ranked_letter(response, letters)
    if benchmark == "videomme":
        return paper_videomme_letter(response)
    return paper_mlvu_letter(response, letters)


def ranked_letter(response: str, letters: str = "ABCD") -> str | None:
    """lmms-eval 0.7's ranked extractor (see the module docstring for the ranks)."""
    text = response.strip()
    for pattern in _ranked_patterns(letters):
        matches = list(pattern.finditer(text))
        if matches:
            return matches[-1].group(1)
    return None


@lru_cache(maxsize=32)
def _ranked_patterns(letters: str) -> tuple[re.Pattern[str], ...]:
    if not re.fullmatch(r"[A-Z]+", letters):
        raise ValueError(f"letters must be capital A-Z, got {letters!r}")
    x = f"([{letters}])"
    alone_before, alone_after = r"(?<![A-Za-z0-9])", r"(?![A-Za-z0-9])"
    return tuple(
        re.compile(pattern)
        for pattern in (
            rf"^[(\[]?\s*{x}\s*(?:[)\].:,\n]|$)",  # 1 start
            rf"{alone_before}[(\[]?{x}[)\]]?[.!]?$",  # 2 end
            rf"(?i:\b(?:answer|option|choice)\b(?:\s+is)?\s*[:=]?\s*)[(\[]?{x}{alone_after}",  # 3 phrase
            rf"\({x}\)",  # 4 (X)
            rf"{alone_before}{x}\.",  # 5 X.
            rf"{alone_before}{x}:",  # 6 X:
            rf"{alone_before}{x}\)",  # 7 X)
            rf"{alone_before}{x} ",  # 8 "X "
            rf"{alone_before}{x}{alone_after}",  # 9 any stand-alone occurrence
        )
    )


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
    benchmark: str, response: str, *, answer: str, letters: str, parser: str = DEFAULT_PARSER
) -> tuple[str | None, bool]:
    """``(letter read from response or None, whether the answer is correct)`` for any benchmark."""
    check_parser(parser)
    if benchmark == "ovobench":
        letter = ovobench_letter(response, answer, letters)
    else:
        letter = parse_answer(benchmark, response, parser, letters)
    return letter, letter == answer
