"""One vocabulary: a method is one registry entry plus its policy, and every consumer takes it from there."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

import statekv
from statekv.cli import main
from statekv.settings.methods import METHODS, MethodSettings, MethodSpec, at_most_budget, method
from statekv.settings.options import ModelOptions
from statekv.testing import make_tiny_checkpoint, write_test_video


@dataclass(frozen=True)
class ValueNorm(statekv.ScoredPolicy):
    """Carry the tokens with the largest values (a policy written in the test)."""

    def score(self, candidates):
        return candidates.values.float().norm(dim=-1)


@pytest.fixture
def valuenorm():
    spec = statekv.register_method(MethodSpec(
        "valuenorm", "carry the largest values", "budget",
        lambda settings, frames_per_step: ValueNorm(budget=settings.budget), at_most_budget, "ValueNorm"))
    yield spec
    METHODS.pop("valuenorm")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods")
    return {"model": make_tiny_checkpoint("internvl", root / "internvl"),
            "video": write_test_video(root / "clip.mp4", frames=24, fps=8)}


def test_a_method_registered_in_a_test_runs_through_the_command_line(valuenorm, files, capsys):
    code = main(["answer", str(files["video"]), "What is shown?", "--model", str(files["model"]), "--method",
                 "valuenorm", "--budget", "12", "--max-new-tokens", "2", "--json", "--attention", "eager"])
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    assert document["method"] == "valuenorm" and document["label"] == "ValueNorm B=12"
    assert document["stats"]["carried_tokens"] == 12 and document["stats"]["frames"] == 3


def test_a_method_registered_in_a_test_is_an_option_everywhere(valuenorm):
    options = ModelOptions.from_strings({"model": "ckpt", "method": "valuenorm", "budget": "64"})
    assert options.spec is valuenorm and options.label == "ValueNorm B=64"
    assert statekv.make_policy("valuenorm", budget=64) == ValueNorm(budget=64)
    from statekv.eval.lmms_plugin import MODEL_ARGS
    from statekv.eval.report import method_label
    from statekv.flops import Method, prefill_flops

    assert method_label("valuenorm", 64) == "ValueNorm B=64"
    assert prefill_flops("internvl3-1b", Method("valuenorm", budget=64), n_frames=8).method.label == "ValueNorm B=64"
    method_arg = next(option for option in MODEL_ARGS if option.name == "method")
    assert method_arg.parse("valuenorm", "method") == "valuenorm"


def test_unknown_methods_and_bad_sizes_are_refused_naming_the_known_ones():
    with pytest.raises(statekv.ConfigurationError, match="unknown method 'snapkv'; choose one of statekv, full"):
        ModelOptions(method="snapkv")
    with pytest.raises(statekv.ConfigurationError, match="budget must be a positive integer, got 0"):
        ModelOptions(budget=0)
    with pytest.raises(statekv.ConfigurationError, match="retrieve must be a positive integer"):
        ModelOptions(retrieve=-1)
    with pytest.raises(statekv.ConfigurationError, match="offload must be disk, memory, a boolean"):
        ModelOptions.from_strings({"offload": "maybe"})


@pytest.mark.parametrize("name, policy", [
    ("statekv", statekv.StateKV(budget=100)), ("full", statekv.FullAttention()),
    ("recency", statekv.Recency(frames=8)), ("rekv", statekv.ReKV(frames=8, sinks=4)),
    ("keynorm", statekv.KeyNorm(budget=100)),
])
def test_the_registered_methods_build_their_policies_with_windows_in_frames(name, policy):
    settings = MethodSettings(budget=100, frames=16, sinks=4)
    assert method(name).policy(settings, 2) == policy  # two frames per step: R = 16 frames is 8 steps


def test_a_command_refuses_its_method_flags_without_loading_the_engine():
    """The methods are described without the engine: `statekv serve --port 99999` or `--method statekv --window 4`
    is refused at once (the engine loads when a policy is first made)."""
    program = ("import sys\nfrom statekv.cli import main\nfrom statekv.errors import ConfigurationError\n"
               "from statekv.settings.methods import method, method_names\n"
               "from statekv.settings.options import ModelOptions\n"
               "print(main(['serve', '--model', 'builtin', '--method', 'rekv', '--port', '99999']))\n"
               "try:\n    ModelOptions.given(method='statekv', window=4)\n"
               "except ConfigurationError as error:\n    print(str(error).split(' (')[0])\n"
               "print(method('rekv').offload, ','.join(method_names()), 'statekv.core' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "2", "window=4 is not used by method='statekv'",
        "True statekv,full,recency,rekv,keynorm,simplestream False"]
    assert "--port 99999: not a port number" in result.stderr


def test_the_command_line_turns_only_statekv_errors_into_one_line(files, capsys, monkeypatch):
    with pytest.raises(SystemExit) as usage:
        main(["answer", str(files["video"]), "q?", "--model", str(files["model"]), "--retrieve", "0"])
    assert usage.value.code == 2 and "argument --retrieve: expected a positive integer, got '0'" in capsys.readouterr().err
    assert main(["answer", str(files["video"]), " ", "--model", str(files["model"])]) == 2
    assert capsys.readouterr().err.strip() == "statekv answer: error: a question is empty"
    import statekv.commands.answer as answer

    def bug(args):
        raise KeyError("a bug, not a user error")

    monkeypatch.setattr(answer, "run", bug)
    with pytest.raises(KeyError):  # a bug keeps its traceback
        main(["answer", str(files["video"]), "q?", "--model", str(files["model"])])


@dataclass(frozen=True)
class QueryWindow(statekv.ScoredPolicy):
    """SnapKV-style: keep the keys the step's last ``window`` queries attend to most (a rule written here)."""

    window: int = 4

    def score(self, candidates):
        queries = candidates.queries[:, :, -self.window:].float()  # [B, Hq, W, D]
        b, hq, w, d = queries.shape
        keys = candidates.keys.float()  # [B, Hkv, N, D]
        grouped = queries.reshape(b, keys.shape[1], -1, d)  # each KV head's query heads, stacked
        return (grouped @ keys.transpose(-1, -2) * d ** -0.5).softmax(-1).sum(2)  # [B, Hkv, N]


@pytest.fixture
def querywindow():
    spec = statekv.register_method(MethodSpec(
        "querywindow", "keep what the step's last queries attend to", "budget",
        lambda settings, frames_per_step: statekv.WithSinks(QueryWindow(budget=settings.budget), settings.sinks),
        at_most_budget, "QueryWindow", also_uses=("sinks",)))  # what it reads besides its size: --sinks is taken
    yield spec
    METHODS.pop("querywindow")


def test_a_query_window_rule_written_here_composes_with_sinks_and_runs_through_the_command_line(querywindow, files,
                                                                                                 capsys, monkeypatch):
    seen = []
    original = QueryWindow.score
    monkeypatch.setattr(QueryWindow, "score", lambda self, c: seen.append(c.queries.shape) or original(self, c))
    code = main(["answer", str(files["video"]), "What is shown?", "--model", str(files["model"]), "--method",
                 "querywindow", "--budget", "12", "--sinks", "3", "--max-new-tokens", "2", "--json"])
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    assert document["method"] == "querywindow" and document["label"] == "QueryWindow B=12"
    assert document["stats"]["carried_tokens"] >= 12 + 3 and seen  # the prefix and sinks, then the rule's 12
    assert all(len(shape) == 4 and shape[2] >= 4 for shape in seen)  # it read the step's queries
