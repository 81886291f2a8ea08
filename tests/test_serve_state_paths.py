"""`statekv serve`'s state folder given from Python (`ServeConfig`), not the command line: a path the server could
not keep its streams under is refused in one line naming it, before the model loads and before anything is made."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi")

from statekv.errors import ConfigurationError  # noqa: E402
from statekv.serve import ServeConfig, create_app  # noqa: E402
from statekv.serve.store import hold_state_folder  # noqa: E402
from statekv.settings.options import ModelOptions  # noqa: E402

KEY = "k" * 32


def _refused(state_dir) -> str:
    with pytest.raises(ConfigurationError) as refused:
        create_app(ServeConfig(options=ModelOptions(model="builtin"), state_dir=state_dir, api_keys=(KEY,),
                               page=False))
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_a_state_folder_too_deep_for_the_streams_saves_is_refused_before_anything_is_made(tmp_path):
    """Before: a state folder whose own path the system takes, but not its streams' saves' (a few dozen bytes
    short of the longest path), served: streams were made and took frames, and every save failed (File name too
    long), their frames lost as the server stopped."""
    longest = os.pathconf(tmp_path, "PC_PATH_MAX") - 1
    deep = str(tmp_path)
    while len(deep) < longest - 300:
        deep += "/" + "d" * 200
    deep += "/" + "e" * (longest - 50 - len(deep))  # the folder itself fits, a save in it does not
    message = _refused(deep)
    assert message.startswith(f"--state-dir {deep}: too deep for the streams' saves in it (File name too long")
    assert not (tmp_path / ("d" * 200)).exists()  # nothing made


def test_a_state_folder_whose_own_path_is_too_long_is_refused_in_one_line(tmp_path):
    message = _refused(tmp_path / ("x" * 300))
    assert message.endswith("File name too long (a name of 300 bytes; this file system takes 255 at most)")


def test_a_state_folder_whose_path_holds_a_newline_is_named_on_one_line(tmp_path):
    """Before: the path was written as it is, so the error naming it (a file in its place, a folder another server
    holds) took two lines, the second looking like a message of its own."""
    taken = tmp_path / "a\nb"
    taken.write_text("not a folder")
    assert "a\\nb: cannot use it as the state folder (File exists: " in _refused(taken)
    held = hold_state_folder(tmp_path / "c\nd", holder="the first server")
    try:
        with pytest.raises(ConfigurationError) as refused:
            hold_state_folder(tmp_path / "c\nd", holder="the second server")
    finally:
        held.release()
    assert "\n" not in str(refused.value) and "c\\nd is in use by the first server" in str(refused.value)
