"""Shared fixtures and helpers: tiny random decoders of the real architectures, saved and loaded via
from_pretrained (`tiny_lm`); tiny random checkpoints of the supported VLM families (`tiny_checkpoint`,
`checkpoint`: InternVL's); random frames (`random_frames`) and a `VideoQA` over a tiny checkpoint as the tests make
it (`tiny_qa`)."""

from __future__ import annotations

import errno
import importlib.util
import io
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch


def _ignored(number, frame):
    """Ignores a signal in this process; unlike SIG_IGN, a handler is not inherited across exec."""


# The commands the tests start are tested as started from a terminal, with SIGINT and SIGHUP at their defaults,
# though the runner may ignore them (a background or nohup job): a child would inherit SIG_IGN, and statekv keeps an
# ignored signal ignored. The tests themselves go on ignoring them.
for _number in (signal.SIGINT, signal.SIGHUP):
    if signal.getsignal(_number) is signal.SIG_IGN:
        signal.signal(_number, _ignored)

# Triton decides at its first import whether to interpret kernels, and transformers imports it: without a GPU,
# ask for the interpreter before that happens so the kernel tests run in this process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from PIL import Image  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config  # noqa: E402

import statekv  # noqa: E402
from statekv.testing import make_tiny_checkpoint  # noqa: E402

WEIGHT_STD = 0.15  # the default 0.02 makes attention nearly uniform and hides selection bugs

FAMILIES = {
    # name: (config class, query heads, KV heads); group sizes 7, 2 and 1
    "qwen2": (Qwen2Config, 7, 1),
    "qwen3": (Qwen3Config, 4, 2),
    "llama": (LlamaConfig, 4, 4),
}


def tiny_config(family: str, *, heads: int | None = None, kv_heads: int | None = None, **overrides):
    config_class, default_heads, default_kv = FAMILIES[family]
    heads, kv_heads = heads or default_heads, kv_heads or default_kv
    head_dim = 8
    fields = dict(vocab_size=96, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=1024, tie_word_embeddings=False)
    fields.update(overrides)
    return config_class(**fields)


def randomize(model: torch.nn.Module, seed: int = 0, std: float = WEIGHT_STD) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1.0 + 0.1 * torch.randn(parameter.shape, generator=generator))
            else:
                parameter.copy_(std * torch.randn(parameter.shape, generator=generator))
    return model


def build_tiny_lm(family: str, path, *, dtype=torch.float32, seed: int = 0, **config_overrides):
    """Save a tiny random causal LM to ``path`` and load it back through ``from_pretrained``."""
    config = tiny_config(family, **config_overrides)
    model = randomize(AutoModelForCausalLM.from_config(config), seed)
    model.save_pretrained(path)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return loaded.eval()


@pytest.fixture(autouse=True)
def torch_threads_kept():
    """Fails a test that leaves torch's intra-op threads changed (and sets them back): on the suite's two cores a
    worker left at two threads spins while it waits for them and slowed every later test of both workers."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        left = torch.get_num_threads()
        torch.set_num_threads(threads)
        pytest.fail(f"the test left torch at {left} threads, not the {threads} it found")


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    """``tiny_lm(family, **overrides)``: a cached tiny model per distinct argument set."""
    cache = {}

    def make(family: str, **kwargs):
        key = (family, repr(sorted(kwargs.items(), key=lambda kv: kv[0])))
        if key not in cache:
            cache[key] = build_tiny_lm(family, tmp_path_factory.mktemp(family), **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family)``: the folder of a tiny random checkpoint of ``family`` (``internvl``,
    ``qwen3_vl``, ``eagle``; `statekv.testing.make_tiny_checkpoint`'s defaults), made once per session and only
    read (a test that changes one copies it first)."""
    made = {}

    def make(family: str):
        if family not in made:
            made[family] = make_tiny_checkpoint(family, tmp_path_factory.mktemp(family) / "ckpt")
        return made[family]

    return make


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoint):
    """A tiny InternVL3 (``-hf``) checkpoint's folder."""
    return tiny_checkpoint("internvl")


def random_frames(count: int, seed: int = 0, height: int = 24, width: int = 32) -> np.ndarray:
    """``count`` RGB frames of random pixels, uint8 ``[count, height, width, 3]``, the same for the same seed."""
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def png_bytes(image: np.ndarray) -> bytes:
    """``image`` (uint8 ``[H, W, 3]``) as a PNG file's bytes, as a client uploads a frame."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def answered_alone(qa, frames, question: str, max_new_tokens: int) -> str:
    """The answer to ``question`` of a stream of ``frames`` (one a second) pushed in one process, never moved."""
    with qa.stream(horizon_frames=16, max_fps=None) as stream:
        for index, image in enumerate(frames):
            stream.push(image, float(index))
        return stream.ask(question, max_new_tokens=max_new_tokens)


TEST_POLICIES = {"statekv": lambda: statekv.StateKV(budget=12), "recency": lambda: statekv.Recency(frames=2),
                 "full": statekv.FullAttention}


def tiny_qa(adapter, policy: str | statekv.CarryPolicy = "statekv", **settings) -> statekv.VideoQA:
    """A `VideoQA` over a tiny checkpoint's ``adapter`` as the tests make it: eager attention and 40 tokens kept
    for the question and answer unless ``settings`` (`VideoQA`'s, the engine's included) say otherwise. policy: a
    carry rule, or a name of `TEST_POLICIES` (StateKV B=12, recency R=2, full attention)."""
    rule = TEST_POLICIES[policy]() if isinstance(policy, str) else policy
    return statekv.VideoQA(adapter, rule, **{"attention": "eager", "reserve_tokens": 40, **settings})


# A prefix chunk then eleven chunks of unequal lengths: 100 tokens in all.
CHUNK_LENGTHS = (9, 7, 12, 5, 10, 6, 11, 8, 9, 4, 13, 6)


def benchmark(name: str):
    """The script ``benchmarks/<name>.py`` imported as a module (its folder on the import path while it loads)."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(folder) / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses resolve their annotations there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(folder)


def split(tokens: torch.Tensor, lengths=CHUNK_LENGTHS) -> list[torch.Tensor]:
    assert sum(lengths) == tokens.shape[1]
    return list(torch.split(tokens, list(lengths), dim=1))


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fails the test if any command gets as far as loading a model's weights."""
    from statekv.models.registry import adapter_for, supported_model_types

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    for adapter in {adapter_for(model_type) for model_type in supported_model_types()}:
        monkeypatch.setattr(adapter, "from_pretrained", refuse)


@pytest.fixture
def small_blocks(monkeypatch):
    """Disk-tier blocks of one page (the smallest a block may be), so a short stream fills many."""
    import mmap

    import statekv.core.disk.buffers as buffers

    monkeypatch.setattr(buffers, "BLOCK_ALIGN", mmap.PAGESIZE)
    monkeypatch.setattr(buffers.MappedTokenBuffer, "BLOCK_BYTES", 1)


@pytest.fixture
def forced_folders(monkeypatch) -> list[str]:
    """The folders forced to the device (an ``os.fsync`` of a folder) from now on, in order."""
    import stat

    forced, fsync = [], os.fsync

    def recording(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            forced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return forced


def failing_folders(monkeypatch, code: int, times: int | None = None) -> list[int]:
    """``os.fsync`` of a folder raises ``code`` from now on (its first ``times`` only, when given); of a file it
    forces as before. Returns the folder flushes tried, in order (their descriptors)."""
    import stat

    real, tried = os.fsync, []

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            tried.append(fd)
            if times is None or len(tried) <= times:
                raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return tried


class Unremovable:
    """Folders ``shutil.rmtree`` cannot remove (as if their files could not go: an error, or nothing done when
    errors are ignored) while in ``stuck``; ``tries``: each try at one of ``watched``, whether it ignored errors."""

    def __init__(self, monkeypatch):
        import shutil

        self.stuck, self.watched, self.tries = set(), set(), []
        rmtree = shutil.rmtree

        def failing_rmtree(path, ignore_errors=False, *args, **kwargs):
            if Path(path) in self.watched:
                self.tries.append(ignore_errors)
            if Path(path) in self.stuck:
                if ignore_errors:
                    return None
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return rmtree(path, ignore_errors, *args, **kwargs)

        monkeypatch.setattr(shutil, "rmtree", failing_rmtree)


@pytest.fixture
def unremovable(monkeypatch) -> Unremovable:
    """`Unremovable` folders, from now on."""
    return Unremovable(monkeypatch)
