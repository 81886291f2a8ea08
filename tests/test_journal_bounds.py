"""A disk tier's journal read back is bounded by what the memory holds: a forged ``compacted`` record of a few
runs standing for more steps than that is refused with one line, as it was when such records were unfolded."""

from __future__ import annotations

import random

import pytest

from statekv.core.disk.files import FORMAT, journal_line, read_file_set, write_checked
from statekv.errors import InputError

MOST = 1 << 40  # as many steps as one record may name: unfolded, 8 TiB a list


def _journal(folder, held: int, tokens: list[int], huge: int) -> None:
    """A file set whose journal holds steps ``0 .. held - 1`` (of ``tokens`` each) whole, then ``huge`` compacted
    steps of 4 tokens, then one more step, checkpointed."""
    folder.mkdir()
    write_checked(folder / "manifest.json", {"format": FORMAT, "version": 4, "file_set": "set",
                                             "geometry": {"layers": 1}})
    records = [{"file_set": "set"},
               {"compacted": [[held, 1, huge]], "tokens": [[4, 0, huge]], "frames": [[1, 0, huge]]},
               *({"step": step, "tokens": tokens[step], "crc": 0, "lengths": {}} for step in range(held)),
               {"step": held + huge, "tokens": 3, "crc": 0, "lengths": {}}, {"carry": held + huge, "slot": 0}]
    (folder / "journal").write_bytes(b"".join(journal_line(record) for record in records))


@pytest.mark.parametrize("irregular, huge", [(False, MOST), (True, MOST - 1000)])
def test_a_journal_naming_more_steps_than_memory_holds_is_refused_with_one_line(tmp_path, irregular, huge):
    """Before: read back as runs, a journal of more than 2**40 steps was taken, and after steps of irregular
    lengths (their list held one integer a step) it was grown a step at a time until the memory ran out."""
    generator = random.Random(0)
    held = 200 if irregular else 3
    _journal(tmp_path / "forged", held, [generator.randint(1, 50) for _ in range(held)], huge)
    with pytest.raises(InputError, match="too many") as error:
        read_file_set(tmp_path / "forged")
    assert "\n" not in str(error.value)
