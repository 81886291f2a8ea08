"""The text a synthetic question is asked with (what follows the video in the user turn)."""

from __future__ import annotations

from collections.abc import Sequence

POST_PROMPT = "Answer with the letter."


def question_prompt(question: str, options: Sequence[str]) -> str:
    """``question``, one ``"A. option"`` line per option, then the instruction to answer with a letter."""
    lines = [question, *(f"{chr(ord('A') + i)}. {option}" for i, option in enumerate(options)), POST_PROMPT]
    return "\n".join(lines)
