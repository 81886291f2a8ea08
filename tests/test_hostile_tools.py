"""The tools around the library (``statekv analyze``, ``statekv flops``, ``statekv train-builtin``'s export and
install) on a disk that takes no more: one line naming the file, and nothing written before is lost or left half
written. A full disk is stood in for by a limit on the size of a file this process writes (RLIMIT_FSIZE: a write
past it fails as a full disk's does, with an OSError)."""

from __future__ import annotations

import contextlib
import json
import signal

import pytest

from statekv.cli import main
from statekv.errors import OutputError

resource = pytest.importorskip("resource")
if getattr(signal, "SIGXFSZ", None) is None or signal.getsignal(signal.SIGXFSZ) != signal.SIG_IGN:
    pytest.skip("needs a system where a write past RLIMIT_FSIZE fails instead of killing the process",
                allow_module_level=True)


@contextlib.contextmanager
def files_at_most(size: int):
    """Every file this process writes holds at most ``size`` bytes meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _one_line(capsys) -> str:
    """The error the command ended with, after checking it is one line (progress lines may come before it)."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    return errors[0]


def test_a_flops_figure_that_cannot_be_written_is_one_line_and_the_earlier_one_stays_whole(tmp_path, capsys):
    """Before: a full disk raised a traceback, and left the figure cut short where a whole one had been."""
    argv = ["flops", "--models", "internvl3-1b", "--frames", "64", "--plot", str(tmp_path)]
    assert main(argv) == 0
    earlier = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    assert sorted(earlier) == ["compute_accuracy_frontier.png", "flops_vs_frames.png"]
    capsys.readouterr()
    with files_at_most(1000):
        assert main(argv) == 2
    error = _one_line(capsys)
    assert "cannot write the plot" in error and "flops_vs_frames.png" in error
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == earlier  # and no partial file


def test_analyze_keeps_its_measurements_when_a_figure_cannot_be_written(tmp_path, capsys):
    """Before: the figures were written first, so a full disk lost the whole analysis with a traceback."""
    clip = tmp_path / "clip.mp4"
    from statekv.testing import write_test_video

    write_test_video(clip, frames=8, fps=4.0)
    out = tmp_path / "report"
    with files_at_most(12_000):  # the JSON and the summary fit, no figure does
        assert main(["analyze", "--model", "builtin", str(clip), "--frames", "4", "--max-fps", "4", "--budgets", "1",
                     "4", "--recency", "1", "--max-distance", "2", "--no-errors", "--out", str(out)]) == 2
    error = _one_line(capsys)
    assert "analysis_concentration.png" in error and "analysis.json and analysis.md hold the analysis" in error
    document = json.loads((out / "analysis.json").read_text())
    assert document["statistics"]["steps"] > 0 and "analysis_concentration.png" in document["figures"]
    assert "analysis_concentration.png" in (out / "analysis.md").read_text()
    assert sorted(path.name for path in out.iterdir()) == ["analysis.json", "analysis.md"]


def test_installing_weights_that_cannot_be_copied_leaves_the_installed_model_as_it_was(tmp_path):
    """Before: the installed files were deleted first, so a copy that failed left no built-in model at all."""
    from statekv.builtin.install import install_weights

    trained, installed = tmp_path / "model", tmp_path / "weights"
    trained.mkdir()
    installed.mkdir()
    (trained / "config.json").write_text('{"new": true}')
    (trained / "model.safetensors").write_bytes(bytes(50_000))
    (trained / "tokenizer.json").write_text("{}")
    for name, text in {"__init__.py": "", "config.json": '{"old": true}', "model.safetensors": "old weights",
                       "special.json": "{}"}.items():
        (installed / name).write_text(text)
    before = {path.name: path.read_bytes() for path in installed.iterdir()}
    with files_at_most(10_000), pytest.raises(OutputError, match="the model installed there is as it was"):
        install_weights(trained, installed)
    assert {path.name: path.read_bytes() for path in installed.iterdir()} == before
    install_weights(trained, installed)
    assert sorted(path.name for path in installed.iterdir()) == ["__init__.py", "config.json", "model.safetensors",
                                                                 "tokenizer.json"]
    assert (installed / "model.safetensors").read_bytes() == bytes(50_000)


def test_an_export_of_the_trained_model_that_cannot_be_written_keeps_the_earlier_one_whole(tmp_path):
    """Before: a full disk raised safetensors' own error, and cut short the weights of the export already there."""
    from safetensors.torch import load_file

    from statekv.builtin.architecture import build_model, build_tokenizer
    from statekv.builtin.checkpoint import save_checkpoint

    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    folder = save_checkpoint(model, tokenizer, tmp_path / "model")
    earlier = {path.name: path.read_bytes() for path in folder.iterdir()}
    with files_at_most(1_000_000), pytest.raises(OutputError, match="cannot write the checkpoint") as error:
        save_checkpoint(model, tokenizer, folder)
    assert "\n" not in str(error.value)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == earlier
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]  # no partial folder left
    assert load_file(folder / "model.safetensors")  # whole: it reads


@pytest.mark.parametrize("steps", ["65", "100000"])
def test_flops_measures_no_more_steps_than_the_frames_it_reports(steps, capsys):
    """Before: ``--measure`` past ``--frames`` measured steps the report does not hold, and a large one ended on an
    error naming ``--max-frames`` and ``--positions``, options ``statekv flops`` does not have."""
    assert main(["flops", "--models", "internvl3-1b", "--frames", "64", "--measure", steps]) == 2
    error = _one_line(capsys)
    assert f"--measure {steps} counts more steps than the --frames 64" in error and "--positions" not in error
