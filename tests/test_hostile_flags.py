"""A setting a method never reads is refused in one line, wherever it is given, even at its default value.

`statekv.settings.methods.refuse_unread` is the one check: the commands (`answer`, `stream`, `eval`),
`VideoQA.from_pretrained`, the lmms-eval plugin's model args and the service's stream settings call it. And a
method that keeps no cache (``simplestream``) never leaves a disk-tier folder behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import statekv
from statekv.cli import main
from statekv.errors import ConfigurationError
from statekv.testing import make_tiny_checkpoint, write_test_video

from hostile import noise_frames

# (flags, what the one line says); every value is the setting's default, so only "was it given" can tell
UNREAD = {
    "window under statekv": (["--method", "statekv", "--window", "4"],
                             "--window 4 is not used by --method statekv (it takes --budget)"),
    "frames under statekv": (["--method", "statekv", "--frames", "16"], "--frames 16 is not used by --method statekv"),
    "sinks under recency": (["--method", "recency", "--sinks", "4"], "--sinks 4 is not used by --method recency"),
    "budget under full": (["--method", "full", "--budget", "4096"], "--budget 4096 is not used by --method full"),
    "retrieve under simplestream": (["--method", "simplestream", "--retrieve", "2"],
                                    "--retrieve 2 is not used by --method simplestream: it keeps no cache"),
    "retrieval under simplestream": (["--method", "simplestream", "--retrieve", "2", "--retrieval", "recent"],
                                     "is not used by --method simplestream: it keeps no cache"),
    "the disk tier under simplestream": (["--method", "simplestream", "--offload", "disk", "--offload-dir", "{root}/d"],
                                         "--offload disk is not used by --method simplestream"),
}
COMMANDS = {
    "answer": ["answer", "{video}", "Why?", "--model", "{model}"],
    "stream": ["stream", "{video}", "--ask", "1:Why?", "--model", "{model}"],
    "eval": ["eval", "synthetic", "--model", "{model}", "--data-root", "{root}", "--out", "{root}/run"],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("flags")
    return {"root": root, "model": make_tiny_checkpoint("internvl", root / "internvl"),
            "video": write_test_video(root / "clip.mp4", frames=8, fps=4)}


def _cli(capsys, *argv) -> tuple[int, str]:
    try:
        code = main([str(arg) for arg in argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) <= 1 and "Traceback" not in err, err
    return code, lines[0] if lines else ""


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", UNREAD)
def test_a_flag_the_method_never_reads_is_one_line_before_the_model_loads(case, command, files, capsys,
                                                                          no_model_loads):
    flags, phrase = UNREAD[case]
    names = {key: str(value) for key, value in files.items()}
    code, line = _cli(capsys, *(arg.format(**names) for arg in COMMANDS[command] + flags))
    assert code == 2 and phrase in line, line
    assert not (files["root"] / "d").exists() and not (files["root"] / "run").exists()  # nothing made


@pytest.mark.parametrize(("kwargs", "phrase"), [
    ({"method": "statekv", "window": 4}, "window=4 is not used by method='statekv' (it takes budget)"),
    ({"method": "recency", "budget": 4096}, "budget=4096 is not used by method='recency' (it takes frames)"),
    ({"method": "simplestream", "retrieve": 2}, "retrieve=2 is not used by method='simplestream'"),
    ({"method": "simplestream", "offload": "disk", "offload_dir": "unused"},
     "offload='disk' is not used by method='simplestream'"),
    ({"method": "statekv", "retrieval": "rekv"}, "retrieval='rekv' picks the frames retrieve answers from"),
])
def test_from_pretrained_refuses_what_the_method_never_reads_before_loading(kwargs, phrase, files, no_model_loads):
    with pytest.raises(ConfigurationError) as error:
        statekv.VideoQA.from_pretrained(files["model"], **kwargs)
    assert phrase in str(error.value) and "\n" not in str(error.value)


def test_what_the_method_reads_is_taken_everywhere(files):
    qa = statekv.VideoQA.from_pretrained(files["model"], method="simplestream", window=4, offload=True)
    assert qa.recent_window == 4
    assert statekv.VideoQA.from_pretrained(files["model"], method="rekv", frames=4, sinks=2,
                                           retrieve=2).retrieve == 2


@pytest.mark.parametrize(("model_args", "phrase"), [
    ({"method": "statekv", "window": "4"}, "window=4 is not used by method='statekv'"),
    ({"method": "simplestream", "retrieve": "2"}, "retrieve=2 is not used by method='simplestream'"),
])
def test_the_lmms_plugin_refuses_a_model_arg_the_method_never_reads(model_args, phrase, monkeypatch, capsys):
    from statekv.eval.lmms_plugin import StateKV

    monkeypatch.setattr(statekv.VideoQA, "from_options", lambda *a, **k: pytest.fail("loaded despite bad args"))
    with pytest.raises(SystemExit) as exit_info:
        StateKV(pretrained="m", **model_args)
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and phrase in error and error.count("\n") == 1, error


def test_the_service_refuses_a_stream_setting_the_method_never_reads(tmp_path):
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from test_hostile_service import Running

    qa = statekv.VideoQA.from_pretrained("builtin", budget=64)
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        for body, phrase in (({"method": "simplestream", "retrieve": 2}, "retrieve=2 is not used by method="),
                             ({"method": "recency", "budget": 64}, "budget=64 is not used by method='recency'"),
                             ({"sinks": 4}, "sinks=4 is not used by method='statekv'")):
            answer = client.post("/v1/streams", json={"horizon_frames": 8, **body})
            assert answer.status_code == 400, answer.text
            message = answer.json()["error"]["message"]
            assert phrase in message and "\n" not in message, message
        taken = client.post("/v1/streams", json={"horizon_frames": 8, "method": "recency", "frames": 4})
        assert taken.status_code == 201, taken.text


def test_simplestream_on_a_disk_tier_engine_leaves_no_folder_behind(files, tmp_path):
    """A server whose engine is on the disk tier may still host a simplestream stream (its method chosen per
    stream): each question's encoding then keeps its cache in host memory, not in a file set nothing resumes."""
    disk = statekv.VideoQA.from_pretrained(files["model"], offload="disk", offload_dir=tmp_path / "tier",
                                           attention="eager", reserve_tokens=40)
    recent = disk.with_options(method="simplestream")
    stream = recent.stream(horizon_frames=8)
    for index, frame in enumerate(noise_frames(3)):
        stream.push(frame, float(index))
    assert stream.ask("Why?", max_new_tokens=2) is not None
    stream.close()
    tier = Path(tmp_path / "tier")
    assert not tier.exists() or not any(tier.iterdir()), sorted(tier.iterdir())
