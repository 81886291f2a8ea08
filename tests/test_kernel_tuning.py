"""The kernel's tile choice, on CPU: pruning by shared memory and registers, shape buckets, the chooser and
the on-disk cache of choices. Pure Python; no GPU and no Triton needed (except the ahead-of-time check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from statekv.kernels.tile_cache import TileCache, default_path
from statekv.kernels.tuning import (
    FLASH_FORWARD_TILES,
    KEY_MASS_TILES,
    MAX_CANDIDATES,
    MAX_REGISTERS,
    Tile,
    choose_tile,
    fitting_tiles,
    registers_per_thread,
    shape_bucket,
    shared_memory_bytes,
)

H100, A100, SMALL = 232_448, 166_912, 65_536  # bytes of shared memory per block (opt-in maximum)
# (Tq, Tk, D, element size): the kernel tests' cases and the benchmark's frames (Tq 259, B up to 16384)
SHAPES = [(37, 137, 64, 4), (259, 359, 64, 2), (1, 101, 128, 2), (37, 37, 80, 4), (259, 259, 80, 2),
          (37, 4133, 64, 2), (1, 1, 128, 4), (5, 25, 256, 4), (259, 16643, 128, 2), (259, 515, 256, 2)]


@pytest.mark.parametrize("limit", [H100, A100, SMALL], ids=["h100", "a100", "64k"])
@pytest.mark.parametrize("pass_name", ["flash", "mass"])
@pytest.mark.parametrize("q_len, k_len, head_dim, element_size", SHAPES, ids=str)
def test_every_candidate_fits_the_device(q_len, k_len, head_dim, element_size, pass_name, limit):
    tiles = fitting_tiles(pass_name, q_len=q_len, k_len=k_len, head_dim=head_dim, element_size=element_size,
                          shared_memory=limit)
    assert 1 <= len(tiles) <= MAX_CANDIDATES and len(set(tiles)) == len(tiles)
    for tile in tiles:
        assert shared_memory_bytes(tile, pass_name, head_dim, element_size) <= limit
        assert registers_per_thread(tile, pass_name, head_dim, element_size) <= MAX_REGISTERS
        assert tile in (FLASH_FORWARD_TILES if pass_name == "flash" else KEY_MASS_TILES)


def test_the_wide_fp32_head_no_longer_gets_a_tile_that_runs_out_of_shared_memory():
    # mha-d256 fp32, Tq = 5: the old pruning left one 16x64 tile with 3 stages (~400 KB by this estimate)
    old_choice = Tile(16, 64, 4, 3)
    assert shared_memory_bytes(old_choice, "flash", 256, 4) > H100
    tiles = fitting_tiles("flash", q_len=5, k_len=25, head_dim=256, element_size=4, shared_memory=H100)
    assert old_choice not in tiles and tiles == [Tile(16, 32, 4, 2), Tile(16, 16, 4, 1)]


def test_tiles_are_not_mostly_padding():
    one_query = fitting_tiles("flash", q_len=1, k_len=5000, head_dim=128, element_size=2, shared_memory=H100)
    assert {tile.block_m for tile in one_query} == {16}
    def short(q_len, k_len):
        return fitting_tiles("mass", q_len=q_len, k_len=k_len, head_dim=64, element_size=2, shared_memory=H100)

    assert short(5, 20) == short(16, 256) and all(tile.block_m <= 16 for tile in short(5, 20))  # one bucket
    frame = fitting_tiles("flash", q_len=259, k_len=4355, head_dim=128, element_size=2, shared_memory=H100)
    assert frame[0] == Tile(128, 64, 8, 3)  # the preferred tile for a frame of a real model in bf16


def test_the_smallest_tile_is_the_last_resort_and_a_device_too_small_is_named():
    tiles = fitting_tiles("flash", q_len=259, k_len=4355, head_dim=256, element_size=4, shared_memory=60_000)
    assert tiles == [Tile(16, 16, 4, 1)]
    with pytest.raises(ValueError, match="head dim 256 .* needs at least 50176 bytes"):
        fitting_tiles("flash", q_len=259, k_len=4355, head_dim=256, element_size=4, shared_memory=4096)


def test_a_stream_is_tuned_for_a_handful_of_buckets():
    # A frame of 259 tokens over a carried state growing to B = 4096, plus text chunks of 1-40 tokens.
    keys = {shape_bucket(q_len, carried + q_len) for q_len in (1, 12, 40, 259) for carried in range(0, 4097, 7)}
    assert len(keys) <= 16
    assert len({shape_bucket(259, carried + 259) for carried in range(0, 4097)}) == 3
    assert shape_bucket(259, 10**6) == shape_bucket(300, 10**7)  # beyond the last bound: one bucket


def test_choose_tile_runs_every_candidate_and_skips_those_that_fail():
    a, b, c = Tile(64, 64, 4, 3), Tile(32, 64, 4, 2), Tile(16, 32, 4, 2)
    times = {a: 3.0, b: 1.0, c: 1.0}
    ran = []

    def bench(tile):
        ran.append(tile)
        if tile == b:
            raise MemoryError("out of resource: shared memory")
        return times[tile]

    assert choose_tile([a, b, c], bench, failures=(MemoryError,)) == c and ran == [a, b, c]
    ran.clear()
    assert choose_tile([a], bench, failures=(MemoryError,)) == a and ran == [a]  # a lone tile is run too
    with pytest.raises(MemoryError):
        choose_tile([b], bench, failures=(MemoryError,))
    with pytest.raises(KeyError):  # anything else is a real error
        choose_tile([Tile(8, 8, 1, 1)], bench, failures=(MemoryError,))
    assert choose_tile([a, Tile(128, 64, 8, 3)], lambda tile: 2.0) == a  # a tie keeps the earlier


IDENTITY = {"device": "NVIDIA H100 80GB HBM3", "capability": "9.0", "triton": "3.9.0", "kernels": "abc"}
TILES = (Tile(128, 64, 8, 3), Tile(64, 64, 4, 3))


def test_tile_cache_survives_the_process_and_merges_what_others_wrote(tmp_path):
    path = tmp_path / "kernels" / "h100.json"
    first, second = TileCache(path, IDENTITY), TileCache(path, IDENTITY)
    first.put("bfloat16-d128-h28/4-q1024-k4096", TILES)
    second.put("bfloat16-d128-h28/4-q64-k4096", TILES[::-1])  # another process, started before the first wrote
    later = TileCache(path, IDENTITY)
    assert later.get("bfloat16-d128-h28/4-q1024-k4096") == TILES
    assert later.get("bfloat16-d128-h28/4-q64-k4096") == TILES[::-1]
    assert not list(path.parent.glob("*.partial"))


def test_tile_cache_ignores_other_identities_and_bad_files(tmp_path):
    path = tmp_path / "cache.json"
    TileCache(path, IDENTITY).put("key", TILES)
    assert TileCache(path, {**IDENTITY, "triton": "3.10.0"}).get("key") is None  # a new Triton tunes afresh
    assert TileCache(path, {**IDENTITY, "kernels": "edited"}).get("key") is None  # so does an edited kernel
    path.write_text("{not json")
    assert TileCache(path, IDENTITY).get("key") is None
    path.write_text(json.dumps({"identity": IDENTITY, "choices": {"key": {"flash": [1, 2]}}}))
    assert TileCache(path, IDENTITY).get("key") is None


def test_an_unwritable_cache_costs_only_the_tuning(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder should be")
    cache = TileCache(blocked / "kernels" / "x.json", IDENTITY)
    cache.put("key", TILES)
    assert cache.get("key") == TILES  # kept in memory for this process


def test_the_cache_lives_under_statekv_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STATEKV_CACHE", str(tmp_path))
    assert default_path("NVIDIA H100 80GB HBM3-sm90") == tmp_path / "kernels" / "scored_attention-nvidia-h100-80gb-hbm3-sm90.json"


AOT_CHECK = textwrap.dedent("""
    from statekv.kernels.ahead_of_time import compile_tile
    from statekv.kernels.tuning import fitting_tiles, shared_memory_bytes

    for arch, limit in ((80, 166912), (90, 232448)):
        for pass_name in ("flash", "mass"):
            tile = fitting_tiles(pass_name, q_len=259, k_len=4355, head_dim=128, element_size=2,
                                 shared_memory=limit)[0]  # the largest candidate for a frame, bf16
            shared = compile_tile(pass_name, tile, "bf16", 128, arch).metadata.shared
            estimate = shared_memory_bytes(tile, pass_name, 128, 2)
            print(arch, pass_name, tuple(tile), shared, estimate)
            assert shared <= estimate <= limit, (shared, estimate)
""")


def test_the_estimate_bounds_what_triton_compiles_for_ampere_and_hopper():
    """Compile the largest candidate tiles for a frame ahead of time (no GPU needed; fp32 would take minutes)
    and read their shared memory."""
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", AOT_CHECK], capture_output=True, text=True, env=env,
                            cwd=Path(__file__).parents[1], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(result.stdout.strip().splitlines()) == 4
