"""The Triton scored-attention kernel against a float64 eager reference.

Without CUDA the kernels run under Triton's interpreter. ``triton.jit`` decides between compiling and
interpreting when a function is defined, Triton's own standard library included, so
``TRITON_INTERPRET=1`` must be set before anything in the process imports Triton. This module sets
it first thing; if a conftest already imported Triton (transformers does, through torch), the
kernel checks rerun in a fresh process instead (``test_kernel_checks_in_fresh_process``).

Cases cover every head layout, head dim, chunk length, carried length and dtype of the contract
without taking their cartesian product.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # importing torch alone does not import Triton

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from statekv import InputError  # noqa: E402
from statekv.kernels import (  # noqa: E402
    ScoredAttentionInputError,
    TritonUnavailableError,
    triton_available,
    triton_scored_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernels_run_in_this_process() -> bool:
    if torch.cuda.is_available():
        return True
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


KERNELS_RUN_HERE = _kernels_run_in_this_process()
KERNEL_TESTS = "matches_float64_reference or strided_inputs"  # the tests marked runs_kernels
runs_kernels = pytest.mark.skipif(
    not KERNELS_RUN_HERE,
    reason="Triton was imported before TRITON_INTERPRET=1; test_kernel_checks_in_fresh_process runs this",
)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
SINKS_PER_HEAD = 3


def reference_scored_attention(q, k, v, scale):
    """Float64 eager attention: (out [B, Tq, Hq, D], key_scores [B, Hkv, Tk])."""
    batch, num_q_heads, q_len, _ = q.shape
    num_kv_heads, k_len = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    keys = k.double().repeat_interleave(group, dim=1)
    values = v.double().repeat_interleave(group, dim=1)
    logits = q.double() @ keys.transpose(-1, -2) * scale
    carried = k_len - q_len
    visible = torch.arange(k_len)[None, :] <= carried + torch.arange(q_len)[:, None]
    probs = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    out = (probs @ values).transpose(1, 2)
    key_scores = probs.sum(dim=2).view(batch, num_kv_heads, group, k_len).sum(dim=2)
    return out, key_scores


def contrasted_inputs(batch, num_q_heads, num_kv_heads, q_len, carried, head_dim, dtype, seed=0):
    """q, k, v ``[B, H, T, D]`` whose attention is far from uniform.

    Queries and keys are N(0, 1.5^2); every query of a KV group also shares a direction ``u``, and a
    few "sink" keys lie along it, so those keys collect several nats more logit than the rest.
    """
    generator = torch.Generator().manual_seed(seed)
    k_len = carried + q_len
    group = num_q_heads // num_kv_heads
    q = torch.randn(batch, num_q_heads, q_len, head_dim, generator=generator) * 1.5
    k = torch.randn(batch, num_kv_heads, k_len, head_dim, generator=generator) * 1.5
    v = torch.randn(batch, num_kv_heads, k_len, head_dim, generator=generator)
    shared = torch.randn(batch, num_kv_heads, 1, head_dim, generator=generator)
    shared = shared / shared.norm(dim=-1, keepdim=True) * (2 * head_dim**0.5) ** 0.5
    q = q + shared.repeat_interleave(group, dim=1)
    sinks = torch.randint(0, k_len, (SINKS_PER_HEAD,), generator=generator)
    k[:, :, sinks] += 3 * shared
    return q.to(dtype), k.to(dtype), v.to(dtype)


def relative_error(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


def check_against_reference(q, k, v):
    scale = q.shape[-1] ** -0.5
    out, key_scores = triton_scored_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), scale=scale)
    out, key_scores = out.cpu(), key_scores.cpu()
    expected_out, expected_scores = reference_scored_attention(q.cpu(), k.cpu(), v.cpu(), scale)
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads, k_len = k.shape[1], k.shape[2]

    assert out.shape == (batch, q_len, num_q_heads, head_dim) and out.dtype == q.dtype
    assert key_scores.shape == (batch, num_kv_heads, k_len) and key_scores.dtype == torch.float32
    tolerance = TOLERANCE[q.dtype]
    assert relative_error(out, expected_out) < tolerance
    assert relative_error(key_scores, expected_scores) < tolerance
    # Each query spreads probability 1 over its keys, in fp32 whatever the input dtype.
    row_total = torch.full((batch, num_kv_heads), float(q_len * num_q_heads // num_kv_heads), dtype=torch.float64)
    torch.testing.assert_close(key_scores.double().sum(dim=-1), row_total, rtol=1e-5, atol=0)


# (batch, Hq, Hkv, Tq, carried, D, dtype)
CASES = [
    pytest.param(2, 4, 4, 37, 100, 64, torch.float32, id="mha-d64-tq37-c100-fp32-b2"),
    pytest.param(1, 14, 2, 259, 100, 64, torch.bfloat16, id="gqa14/2-d64-tq259-c100-bf16"),
    pytest.param(1, 16, 8, 1, 100, 128, torch.float16, id="gqa16/8-d128-tq1-c100-fp16"),
    pytest.param(1, 28, 4, 37, 0, 80, torch.float32, id="gqa28/4-d80-tq37-c0-fp32"),
    pytest.param(1, 4, 2, 259, 0, 80, torch.float16, id="gqa4/2-d80-tq259-c0-fp16"),
    pytest.param(1, 2, 1, 37, 4096, 64, torch.bfloat16, id="gqa2/1-d64-tq37-c4096-bf16"),
    pytest.param(1, 14, 2, 1, 0, 128, torch.float32, id="gqa14/2-d128-tq1-c0-fp32"),
    pytest.param(1, 2, 2, 5, 20, 256, torch.float32, id="mha-d256-tq5-c20-fp32"),
]


@pytest.mark.cuda
@runs_kernels
@pytest.mark.parametrize("batch, num_q_heads, num_kv_heads, q_len, carried, head_dim, dtype", CASES)
def test_matches_float64_reference(batch, num_q_heads, num_kv_heads, q_len, carried, head_dim, dtype):
    q, k, v = contrasted_inputs(batch, num_q_heads, num_kv_heads, q_len, carried, head_dim, dtype)
    check_against_reference(q, k, v)


@pytest.mark.cuda
@runs_kernels
def test_strided_inputs():
    """q as a transposed [B, Tq, Hq, D] view, k as a slice of a longer cache, v transposed."""
    q, k, v = contrasted_inputs(1, 28, 4, 37, 100, 128, torch.float32, seed=1)
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_buffer = torch.zeros(1, 4, k.shape[2] + 64, 128, device=DEVICE)
    k_buffer[:, :, : k.shape[2]] = k
    k_strided = k_buffer[:, :, : k.shape[2]]
    v_strided = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not (q_strided.is_contiguous() or k_strided.is_contiguous() or v_strided.is_contiguous())
    check_against_reference(q_strided, k_strided, v_strided)


def test_inputs_have_contrast():
    """Guard the tests' own inputs: near-uniform attention would hide masking and selection bugs."""
    q, k, v = contrasted_inputs(1, 14, 2, 37, 100, 64, torch.float32)
    _, key_scores = reference_scored_attention(q, k, v, 64**-0.5)
    mean_mass = key_scores.mean(dim=-1, keepdim=True)
    assert (key_scores.amax(dim=-1) > 20 * mean_mass.squeeze(-1)).all()


def test_triton_available_follows_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert triton_available() == torch.cuda.is_available()


def zeros(q_shape, kv_shape, v_shape=None, dtype=torch.float32):
    """q, k, v of the given shapes (v defaults to k's shape)."""
    return tuple(torch.zeros(shape, dtype=dtype) for shape in (q_shape, kv_shape, v_shape or kv_shape))


Q, KV = (1, 4, 8, 64), (1, 2, 8, 64)
MIXED_DTYPES = (torch.zeros(Q), torch.zeros(KV, dtype=torch.float16), torch.zeros(KV, dtype=torch.float16))


@pytest.mark.parametrize(
    "q, k, v, message",
    [
        pytest.param(*zeros((1, 4, 8), KV), "4-D tensor", id="not-4d"),
        pytest.param(*zeros(Q, KV, v_shape=(1, 2, 9, 64)), "k and v shapes differ", id="k-vs-v"),
        pytest.param(*zeros(Q, (1, 2, 8, 32)), "batch or head dim", id="head-dim"),
        pytest.param(*zeros((1, 6, 8, 64), (1, 4, 8, 64)), "not a multiple of KV heads", id="groups"),
        pytest.param(*zeros((1, 4, 9, 64), KV), r"more queries than keys \(Tq=9 > Tk=8\)", id="tq>tk"),
        pytest.param(*zeros((1, 4, 0, 64), KV), "empty input", id="empty"),
        pytest.param(*zeros((1, 4, 8, 320), (1, 2, 8, 320)), "head dim 320 exceeds", id="d>256"),
        pytest.param(*zeros(Q, KV, dtype=torch.float64), "unsupported dtype", id="fp64"),
        pytest.param(*MIXED_DTYPES, "dtypes differ", id="mixed-dtypes"),
    ],
)
def test_bad_inputs_raise_clear_errors(q, k, v, message):
    with pytest.raises(ScoredAttentionInputError, match=message):
        triton_scored_attention(q, k, v, scale=0.125)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = zeros(Q, KV)
    with pytest.raises(InputError, match="needs CUDA tensors"):
        triton_scored_attention(q, k, v, scale=0.125)


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="Triton interprets or compiles kernels in this process")
def test_interpreter_requested_after_triton_import_is_refused():
    with pytest.raises(TritonUnavailableError, match="imported before TRITON_INTERPRET=1"):
        triton_scored_attention(*zeros(Q, KV), scale=0.125)


def test_package_imports_without_triton():
    """``statekv.kernels`` must import, and report itself unavailable, where Triton cannot load."""
    script = textwrap.dedent(
        """
        import sys

        class BlockTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton blocked for this test")

        sys.meta_path.insert(0, BlockTriton())
        import statekv.kernels
        assert "statekv.kernels.scored_attention" not in sys.modules
        assert not statekv.kernels.triton_available()
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel checks already ran in this process")
def test_kernel_checks_in_fresh_process():
    """Run the kernel tests again where TRITON_INTERPRET=1 precedes the first import of Triton."""
    command = [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", "-k", KERNEL_TESTS,
               __file__]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1], timeout=600
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith(f"{len(CASES) + 1} passed") and "skipped" not in summary, result.stdout[-2000:]
