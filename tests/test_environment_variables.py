"""The environment variables statekv reads: a malformed value is one line naming the variable, never a traceback
nor a path that moves with the working folder."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from statekv.cli import main
from statekv.errors import ConfigurationError
from statekv.testing import make_tiny_checkpoint, write_test_video
from statekv.user_cache import cache_dir, secret_path

NO_SUCH_USER = "~no-such-user-statekv-test"


def _cli(capsys, argv) -> tuple[int, str, str]:
    try:
        code = main([str(arg) for arg in argv])
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("value", ["cache", "3", f"{NO_SUCH_USER}/cache"])
def test_a_relative_or_unexpandable_cache_folder_is_refused_naming_the_variable(monkeypatch, value):
    """Before: a relative STATEKV_CACHE was a folder of the working folder (and so this installation's secret, which
    owners' streams are keyed by, changed with it); a ~ of no home folder was pathlib's RuntimeError."""
    monkeypatch.setenv("STATEKV_CACHE", value)
    with pytest.raises(ConfigurationError, match=f"STATEKV_CACHE={value!r}"):
        cache_dir()


def test_a_relative_secret_file_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("STATEKV_SECRET_FILE", "installation.secret")
    with pytest.raises(ConfigurationError, match="STATEKV_SECRET_FILE='installation.secret' is a relative path"):
        secret_path()


def test_a_relative_xdg_cache_home_is_ignored_as_the_xdg_spec_says(monkeypatch, tmp_path):
    monkeypatch.delenv("STATEKV_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "statekv"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "statekv"


def test_the_demo_with_an_unexpandable_cache_folder_is_one_line(monkeypatch, capsys):
    """Before: pathlib's RuntimeError (Could not determine home directory), as a traceback."""
    monkeypatch.setenv("STATEKV_CACHE", f"{NO_SUCH_USER}/cache")
    code, _, err = _cli(capsys, ["demo", "--model", "builtin"])
    assert code == 2 and f"STATEKV_CACHE='{NO_SUCH_USER}/cache': its ~ names no home folder" in _one_line(err)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("environment")
    return {"model": make_tiny_checkpoint("internvl", root / "internvl"),
            "video": write_test_video(root / "clip.mp4", frames=16, fps=8)}


def test_a_failed_save_is_rescued_to_the_temporary_folder_when_the_cache_variable_is_malformed(
        files, capsys, tmp_path, monkeypatch):
    """Before: the rescue stopped at the cache folder's RuntimeError, a traceback, and the stream was lost."""
    from hostile import fill_disk_beside

    target, scratch = tmp_path / "out" / "talk.safetensors", tmp_path / "tmp"
    target.parent.mkdir()
    scratch.mkdir()
    fill_disk_beside(monkeypatch, target)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setenv("STATEKV_CACHE", f"{NO_SUCH_USER}/cache")
    code, out, err = _cli(capsys, ["stream", files["video"], "--model", files["model"], "--budget", "20",
                                   "--ask", "1:Why?", "--max-new-tokens", "2", "--save", target, "--json"])
    line = _one_line(err)
    assert code == 2 and f"could not save the stream to {target} (No space left on device)" in line
    assert Path(line.rsplit("saved to ", 1)[1].removesuffix(" instead")).parent == scratch
    assert json.loads(out.splitlines()[-1])["save_error"] == "No space left on device"


@pytest.mark.parametrize("variable, flags", [("k\udcff", []), ("", ["--api-key", "clé"])])
def test_an_api_key_no_client_could_send_is_one_line_naming_where_it_came_from(monkeypatch, capsys, tmp_path,
                                                                              variable, flags):
    """Before: a key of bytes that are not UTF-8 was a UnicodeEncodeError traceback once the model had loaded; a
    key of other characters than ASCII was taken, and no request could ever carry it."""
    pytest.importorskip("fastapi")
    monkeypatch.setenv("STATEKV_API_KEYS", variable)
    code, out, err = _cli(capsys, ["serve", "--model", "builtin", "--state-dir", tmp_path / "state", "--port", "0",
                                   *flags])
    source = "--api-key" if flags else "STATEKV_API_KEYS"
    assert code == 2 and f"{source}: an API key must be printable ASCII" in _one_line(err)
    assert "clé" not in err + out and not (tmp_path / "state").exists()


def test_bench_serve_takes_the_first_key_the_server_would_accept(monkeypatch, capsys):
    """Before: STATEKV_API_KEYS=",KEY" (which `statekv serve` reads as KEY) was "--url needs --api-key"."""
    pytest.importorskip("httpx")
    monkeypatch.setenv("STATEKV_API_KEYS", " , key-1,key-2")
    code, _, err = _cli(capsys, ["bench", "serve", "--url", "http://127.0.0.1:9", "--streams", "1", "--duration", "1"])
    assert code == 2 and "cannot reach http://127.0.0.1:9: " in _one_line(err)


@pytest.mark.parametrize("omp, threads", [("", 1), ("lots", 1), ("2", 2)])
def test_the_demo_takes_one_thread_unless_omp_num_threads_asks_for_a_count(monkeypatch, capsys, tmp_path, omp,
                                                                            threads):
    """Before: an empty (or unreadable) OMP_NUM_THREADS, which torch ignores, kept the demo on torch's default of a
    thread per core, the contention the demo's one thread avoids."""
    import torch

    import statekv

    seen = []

    def loading(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise ConfigurationError("stopped here")

    monkeypatch.setattr(statekv.VideoQA, "from_pretrained", loading)
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        code, _, err = _cli(capsys, ["demo", "--video", write_test_video(tmp_path / "clip.mp4", frames=4, fps=4)])
    finally:
        torch.set_num_threads(before)
    assert code == 2 and "stopped here" in err and seen == [threads]


@pytest.mark.parametrize("value", ["0", "two", "²"])
def test_a_tile_candidates_value_that_is_not_a_count_is_one_line_naming_the_variable(monkeypatch, value):
    """Before: a digit int() cannot read ("²", which str.isdigit takes) was int()'s ValueError."""
    from statekv.kernels.tuning import tile_candidates

    monkeypatch.setenv("STATEKV_TILE_CANDIDATES", value)
    with pytest.raises(ConfigurationError, match="^STATEKV_TILE_CANDIDATES must be a positive integer"):
        tile_candidates()


def test_every_environment_variable_statekv_reads_is_in_the_readmes_table():
    """Before: STATEKV_CACHE, XDG_CACHE_HOME and STATEKV_TILE_CANDIDATES were read but named nowhere a user looks
    (STATEKV_CACHE only deep in docs/kernel.md), nor RANK/WORLD_SIZE/LOCAL_RANK in the README."""
    import re

    root = Path(__file__).resolve().parents[1]
    read = set()
    for source in (root / "statekv").rglob("*.py"):
        text = source.read_text()
        read |= set(re.findall(r'(?:environ(?:\.get)?[\[(]|variable_path\()\s*"([A-Z][A-Z0-9_]*)"', text))
        read |= set(re.findall(r'^[A-Z_]*VARIABLE = "([A-Z][A-Z0-9_]*)"', text, re.MULTILINE))
    readme = (root / "README.md").read_text()
    table = readme.split("### Environment variables", 1)[1].split("\n#", 1)[0]
    assert {"STATEKV_CACHE", "STATEKV_SECRET_FILE", "STATEKV_API_KEYS", "OMP_NUM_THREADS", "RANK"} <= read
    assert sorted(name for name in read if not re.search(rf"\b{name}\b", table)) == []


def test_statekvs_help_names_its_cache_folders_variable(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "STATEKV_CACHE (statekv's cache folder, default ~/.cache/statekv)" in out and "Environment variables" in out
