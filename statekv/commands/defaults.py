"""Method settings that show the method on the built-in model, shared by the commands that default to it
(``statekv demo`` and ``statekv serve``): its frames are 4 tokens, so the engine's default budget (4096 tokens)
would carry every token of any video it can hold, and StateKV would never choose anything."""

from __future__ import annotations

from ..builtin import is_builtin

BUILTIN_BUDGET = 64  # tokens per layer and KV head: 16 frames' worth, as recency's window
BUILTIN_WINDOW = 16  # frames


def builtin_budget(model: str | None, given: int | None, otherwise: int) -> int:
    """The StateKV budget: ``given`` when the user chose one, else `BUILTIN_BUDGET` for the built-in model and
    ``otherwise`` for any other."""
    if given is not None:
        return given
    return BUILTIN_BUDGET if is_builtin(model) else otherwise
