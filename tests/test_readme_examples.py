"""The README's Python examples run as written, offline: each ```python block is executed with only the names of
things that cannot exist here substituted (a hub checkpoint -> a tiny random one of the same family and context,
CUDA -> the CPU, bfloat16 -> float32, which a CPU runs many times faster, the user's video, camera and chunks ->
test ones). Every substitution is listed in `_substituted`, so anything else an example says (an option, a value
such as ``max_cache_bytes="20G"``, a horizon, a method's name) is what runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

import statekv
from statekv.testing import make_tiny_checkpoint, write_test_video

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    vlm = make_tiny_checkpoint("internvl", root / "internvl",  # a real range: the live stream's question fits it
                               text_config={"max_position_embeddings": 4096,
                                            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    lm = root / "qwen2"  # a causal LM with the tiny VLM's tokenizer, for the engine's example
    tokenizer = AutoTokenizer.from_pretrained(vlm)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1e6)  # Qwen2.5-0.5B's context and RoPE
    AutoModelForCausalLM.from_config(config).save_pretrained(lm)
    tokenizer.save_pretrained(lm)
    return {"vlm": vlm, "lm": lm, "root": root}


def _substituted(code: str, checkpoints) -> str:
    substitutions = {
        '"OpenGVLab/InternVL3-1B-hf"': repr(str(checkpoints["vlm"])),
        '"Qwen/Qwen2.5-0.5B-Instruct"': repr(str(checkpoints["lm"])),
        'device="cuda"': 'device="cpu"',
        'dtype="bfloat16"': 'dtype="float32"',
        "dtype=torch.bfloat16": "dtype=torch.float32",
    }
    for old, new in substitutions.items():
        code = code.replace(old, new)
    return code


def test_the_readme_has_the_examples_this_file_runs():
    blocks = _python_blocks()
    assert len(blocks) == 4
    assert "qa.encode(" in blocks[0] and "qa.stream(" in blocks[1] and "stream.watch(" in blocks[2]
    assert "StreamingPrefill(" in blocks[3]


def test_the_quick_start_and_the_live_stream_run_as_written(checkpoints, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_test_video(tmp_path / "lecture.mp4", frames=6, fps=1)
    frames = np.random.default_rng(0).integers(0, 256, (4, 24, 32, 3), dtype=np.uint8)
    namespace = {"camera": list(zip(frames, (0.0, 1.0, 2.0, 600.0))), "asked": False}
    quick_start, live = _python_blocks()[:2]
    exec(_substituted(quick_start, checkpoints), namespace)
    assert namespace["video"].frames == 6
    exec(_substituted(live, checkpoints), namespace)
    assert isinstance(namespace["stream"], statekv.Stream) and namespace["stream"].frames == 4
    assert (tmp_path / "desk.safetensors").is_file()
    namespace["camera"] = [(frame, 601.0 + index) for index, frame in enumerate(np.concatenate([frames, frames]))]
    exec(_substituted(_python_blocks()[2], checkpoints), namespace)  # the watch, on the stream loaded back
    watch = namespace["watch"]
    assert watch.evaluations == 3 and watch.events and namespace["stream"].watches == [watch]


def test_the_engine_example_runs_as_written(checkpoints):
    hidden = AutoModelForCausalLM.from_pretrained(checkpoints["lm"]).config.hidden_size
    chunks = [torch.randn(1, 5, hidden) for _ in range(3)]
    namespace = {"chunks": chunks}
    exec(_substituted(_python_blocks()[3], checkpoints), namespace)
    assert namespace["answer_ids"].shape[0] == 1 and namespace["prefill"].seen_tokens == 15


def test_the_disk_tier_and_cap_options_the_readme_names_are_taken_in_python(checkpoints, tmp_path):
    # "offload="disk", offload_dir=DIR ... and max_cache_bytes="20G" with cache_limit=... caps it"
    qa = statekv.VideoQA.from_pretrained(checkpoints["vlm"], offload="disk", offload_dir=tmp_path,
                                         max_cache_bytes="20G", cache_limit="evict-oldest")
    assert qa.engine.max_cache_bytes == 20 << 30
    stream = qa.stream(horizon_frames=2)
    stream.push(np.zeros((24, 32, 3), dtype=np.uint8))
    assert stream.frames == 1 and stream.prefill.disk.folder.parent == tmp_path
