"""The Triton rotation of carried keys (`statekv.kernels.rotation.rotate_keys`) against the eager `rotate`, and the
placed steps that use it. Without CUDA the kernel runs under Triton's interpreter (conftest asks for it before
Triton is first imported)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from statekv.core import StateKV, StreamingPrefill  # noqa: E402
from statekv.core.positions.layouts import GroupedDistances  # noqa: E402
from statekv.core.positions.rotation import place_carried, rotate  # noqa: E402
from statekv.kernels import rotation as kernel  # noqa: E402
from statekv.kernels.availability import triton_available  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LIMIT = 64

pytestmark = pytest.mark.skipif(not triton_available(), reason="no CUDA and Triton was imported before "
                                "TRITON_INTERPRET=1")


def frequencies(rotary: int, base: float = 1e4) -> torch.Tensor:
    return (1.0 / (base ** (torch.arange(0, rotary, 2, device=DEVICE).float() / rotary))).float()


@pytest.mark.parametrize("dtype, dim, rotary, tolerance", [
    (torch.float32, 8, 8, 1e-5),
    (torch.float32, 12, 8, 1e-5),  # partial rotary: the dims past it copied as they are
    (torch.float32, 6, 6, 1e-5),  # half a key's rotary dims not a power of two
    (torch.bfloat16, 16, 16, 1e-2),
], ids=["float32", "partial rotary", "odd half", "bfloat16"])
def test_the_kernel_rotates_as_the_eager_rotation(dtype, dim, rotary, tolerance):
    """Into a slice of a wider buffer (a placed step's keys leave the chunk's rows after the carried ones), with
    deltas far past the model's range (where an approximate sine or cosine would drift) and some zero."""
    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 3, 70, dim, generator=generator).to(DEVICE, dtype)
    delta = torch.randint(-100_000, 100_000, (2, 3, 70), generator=generator).to(DEVICE)
    delta[..., :5] = 0
    inv_freq = frequencies(rotary)
    wide = torch.full((2, 3, 74, dim), 7.0, device=DEVICE, dtype=dtype)
    assert kernel.rotate_keys(keys, delta, inv_freq, wide[..., :70, :])
    expected = rotate(keys, delta, inv_freq)
    torch.testing.assert_close(wide[..., :70, :], expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(wide[..., :5, :], keys[..., :5, :])
    assert torch.equal(wide[..., 70:, :], torch.full_like(wide[..., 70:, :], 7.0))  # the chunk's rows untouched


def test_the_kernel_takes_a_delta_broadcast_over_heads():
    keys = torch.randn(1, 4, 9, 8, device=DEVICE)
    delta = torch.arange(9, device=DEVICE)[None, None].expand(1, 4, 9) * 300
    out = torch.empty_like(keys)
    assert kernel.rotate_keys(keys, delta, frequencies(8), out)
    torch.testing.assert_close(out, rotate(keys, delta, frequencies(8)), rtol=1e-5, atol=1e-5)


def test_the_kernel_leaves_a_layout_it_cannot_read_to_the_caller():
    """Keys whose dims are not contiguous are refused, with nothing written."""
    keys = torch.randn(1, 2, 8, 5, device=DEVICE).transpose(-1, -2)  # [1, 2, 5, 8], last dim strided
    out = torch.zeros(1, 2, 5, 8, device=DEVICE)
    assert not kernel.rotate_keys(keys, torch.ones(1, 2, 5, dtype=torch.long, device=DEVICE), frequencies(8), out)
    assert not out.any()


def test_placing_carried_keys_fused_is_placing_them_eagerly():
    """Every layer's placed keys, stacked or alone, through the kernel are the eager rotation's."""
    generator = torch.Generator().manual_seed(3)
    carried = []
    for size in (6, 6, 0, 4):
        keys = torch.randn(1, 2, size, 8, generator=generator).to(DEVICE)
        anchors = torch.sort(torch.randint(0, 500, (1, 2, size), generator=generator)).values.to(DEVICE)
        carried.append((keys, torch.stack([anchors, anchors % 60])) if size else None)
    placer = GroupedDistances().place(torch.tensor([500], device=DEVICE), torch.tensor([40], device=DEVICE), 4,
                                      LIMIT)
    eager = place_carried(placer, frequencies(8), carried, chunk_len=4)
    fused = place_carried(placer, frequencies(8), carried, chunk_len=4, fused=True)
    for entry, want, got in zip(carried, eager, fused):
        if entry is None:
            assert got is None
            continue
        size = entry[0].shape[2]
        torch.testing.assert_close(got[:, :, :size], want[:, :, :size], rtol=1e-5, atol=1e-5)


def test_a_bounded_stream_past_the_range_places_its_keys_with_the_kernel(tiny_lm, monkeypatch):
    """With the Triton attention backend, a bounded stream's placed steps rotate through the kernel, and its
    outputs are those of the same stream on the eager backend."""
    model = copy.deepcopy(tiny_lm("qwen2", max_position_embeddings=LIMIT, num_hidden_layers=2)).to(DEVICE)
    calls = []
    original = kernel.rotate_keys
    monkeypatch.setattr(kernel, "rotate_keys", lambda *args: calls.append(1) or original(*args))
    embed = model.get_input_embeddings()
    chunks = [embed(torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(i)).to(DEVICE)).detach()
              for i in range(12)]
    outputs = {}
    for backend in ("eager", "triton"):
        prefill = StreamingPrefill(model, StateKV(16), positions="bounded", attention=backend)
        outputs[backend] = [prefill.step(inputs_embeds=chunk) for chunk in chunks]
        assert prefill.seen_tokens > LIMIT
    assert calls  # the eager backend never calls it: each call is a placed step on the Triton one
    for eager, fused in zip(outputs["eager"], outputs["triton"]):
        torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
