"""Bounded RoPE positions: exactly the stream's while they fit, inside the trained range past it, never an end."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from statekv.core import FullAttention, PerLayerBudget, Recency, Retrieval, StateKV, StreamingPrefill
from statekv.core.rules import CarryPolicy
from statekv.core.positions.layouts import CacheOrder, GroupedDistances, OwnThenCache
from statekv.core.positions.placing import StreamPositions, choose_positions
from statekv.core.positions.rope import trained_range
from statekv.core.positions.rotation import rotate
from statekv.errors import ConfigurationError, HorizonError, InputError

from conftest import split

LIMIT = 64  # the tiny model's trained range


@pytest.fixture
def model(tiny_lm):
    return tiny_lm("qwen2", max_position_embeddings=LIMIT)


def tokens(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (1, count), generator=torch.Generator().manual_seed(seed))


def test_rotate_is_ropes_own_rotation(model):
    """A key rotated at p, then by delta, is the key RoPE rotates at p + delta (the model's own frequencies)."""
    rotary = model.model.rotary_emb
    keys = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(1))
    at = torch.tensor([[3, 10, 40, 7, 63]])
    delta = torch.tensor([[5, -10, 17, 0, -60]])
    cos, sin = rotary(keys, at)
    stored, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
    cos, sin = rotary(keys, at + delta)
    expected, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
    moved = rotate(stored, delta.expand(1, 2, -1), rotary.inv_freq)
    torch.testing.assert_close(moved, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(rotate(stored, torch.zeros(1, 2, 5, dtype=torch.long), rotary.inv_freq), stored)


@pytest.mark.parametrize("policy", [FullAttention(), StateKV(16)], ids=["full", "statekv"])
def test_bounded_is_the_stream_while_it_fits(model, policy):
    """Inside the range, bounded positions are stream positions: the same hidden states and answers, bit for bit."""
    chunks = split(tokens(100))[:6]  # 49 tokens: inside the cap of 56
    runs = {}
    for mode in ("stream", "bounded"):
        prefill = StreamingPrefill(model, policy, positions=mode)
        hidden = [prefill.step(input_ids=chunk) for chunk in chunks]
        answer = prefill.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
        runs[mode] = hidden, answer, prefill.last_context
    for a, b in zip(runs["stream"][0], runs["bounded"][0]):
        assert torch.equal(a, b)
    assert torch.equal(runs["stream"][1], runs["bounded"][1])
    assert runs["bounded"][2] == "whole"


POLICIES = [FullAttention(), StateKV(16), Recency(frames=2)]


@pytest.mark.parametrize("policy", POLICIES, ids=["full", "statekv", "recency"])
def test_bounded_steps_cost_the_streams_while_they_fit(model, policy):
    """Inside the range a bounded step is a stream-positions step: the same ops, in the same carried form
    (a window, slots or the ring: nothing placed or rotated); from the first step placed elsewhere on, every layer
    carries slots with placements."""
    from statekv.testing.op_trace import OpTrace

    embed = model.get_input_embeddings()
    chunks = [embed(tokens(4, seed)).detach() for seed in range(20)]
    ops = {}
    for mode in ("stream", "bounded", "stream", "bounded"):  # the second of each: every mask shape built already
        prefill = StreamingPrefill(model, policy, positions=mode)
        ops[mode] = []
        for chunk in chunks[:12]:  # 48 tokens: inside the cap of 56
            with OpTrace() as trace:
                prefill.step(inputs_embeds=chunk)
            ops[mode].append(trace.compute)
        forms = {layer.form for layer in prefill.cache.layers}
        assert not prefill.cache.placed and forms == {"window" if policy is POLICIES[0] else
                                                      "slots" if policy is POLICIES[1] else "ring"}
    assert ops["stream"] == ops["bounded"]
    for chunk in chunks[12:]:
        prefill.step(inputs_embeds=chunk)
    assert prefill.positions.moved and prefill.cache.placed
    assert all(layer.form == "slots" and layer.slots.placements is not None for layer in prefill.cache.layers)


@pytest.mark.parametrize("policy", POLICIES, ids=["full", "statekv", "recency"])
def test_a_bounded_stream_saved_before_it_moved_resumes_exactly(model, policy):
    """Saved while every step sat at its own position (no placements kept), resumed, and streamed past the range:
    the same hidden states as the stream that never stopped."""
    embed = model.get_input_embeddings()
    chunks = [embed(tokens(4, seed)).detach() for seed in range(24)]
    whole = StreamingPrefill(model, policy, positions="bounded")
    expected = [whole.step(inputs_embeds=chunk) for chunk in chunks]
    first = StreamingPrefill(model, policy, positions="bounded")
    for chunk in chunks[:8]:
        first.step(inputs_embeds=chunk)
    tensors, metadata = first.state_dict()
    assert not any(name.endswith("carried_placements") for name in tensors)
    resumed = StreamingPrefill(model, policy, positions="bounded")
    resumed.load_state_dict(tensors, metadata)
    assert not resumed.cache.placed
    for chunk, reference in zip(chunks[8:], expected[8:]):
        assert torch.equal(resumed.step(inputs_embeds=chunk), reference)
    assert resumed.cache.placed


class Recording(CarryPolicy):
    """StateKV's selection, recording what each step's attention saw (keys, logical positions)."""

    def __init__(self, budget):
        self.inner, self.seen = StateKV(budget), []

    def scores_needed(self, size):
        return self.inner.scores_needed(size)

    def select(self, candidates):
        self.seen.append((candidates.layer, candidates.keys.clone(), candidates.positions.clone()))
        return self.inner.select(candidates)


def grouped_target(distance: int, first: int, base: int, limit: int) -> int:
    """The grouped layout, written out: exact up to the window, then grouped by the smallest fitting group."""
    cap = limit - -(-limit // 8)
    window = cap // 2
    group = max(1, -(-(first - window) // (cap - window)))
    mapped = distance if distance <= window else window + -(-(distance - window) // group)
    return base - min(mapped, base)


def test_bounded_places_keys_inside_the_range_past_it(model, monkeypatch):
    """Past the range every rotary position stays inside it: the chunk at its base, each carried key rotated
    from the rotation it was stored at to the layout's place for it (the grouped layout, checked against a
    direct computation)."""
    monkeypatch.setattr("statekv.core.positions.layouts.DEFAULT_LAYOUT", GroupedDistances.name)
    policy = Recording(16)
    prefill = StreamingPrefill(model, policy, positions="bounded")
    seen_positions = []
    hook = model.model.rotary_emb.register_forward_hook(lambda m, args, out: seen_positions.append(args[1].clone()))
    try:
        for chunk in split(tokens(100)) + split(tokens(100, seed=1)):
            prefill.step(input_ids=chunk)
    finally:
        hook.remove()
    assert prefill.seen_tokens == 200 > LIMIT
    assert max(int(p.max()) for p in seen_positions) < LIMIT
    positions = prefill.positions
    layer = model.config.num_hidden_layers - 1
    steps = [(keys, logical) for index, keys, logical in policy.seen if index == layer]
    starts = [0]
    for span in positions.spans:
        starts.append(starts[-1] + span)
    stored = prefill.cache.layers[layer].storage
    for step in (10, 20, len(steps) - 1):
        keys, logical = steps[step]
        first, base = positions.firsts[step], positions.bases[step]
        assert first == starts[step] and base < LIMIT
        expected = torch.empty_like(keys)
        for slot in range(logical.shape[-1]):
            token = int(logical[0, 0, slot])
            owner = max(s for s in range(len(starts) - 1) if starts[s] <= token)
            rotation = token - (positions.firsts[owner] - positions.bases[owner])
            target = grouped_target(first - token, first, base, LIMIT)
            key = stored.read_tokens(torch.tensor([token]))[0][:, :, :1]
            expected[:, :, slot:slot + 1] = rotate(key, torch.tensor([[[target - rotation]]]),
                                                   positions.inv_freq)
        torch.testing.assert_close(keys, expected, rtol=1e-5, atol=1e-5)


def test_layouts_place_carried_keys_as_written_out():
    """Each layout's places for carried tokens, against the rules written out: grouped (Self-Extend's), cache order
    (consecutive, ending right before the chunk), and own-then-cache choosing between them; a stream that knows it
    was placed (``moved``) gets the same places as the device's own choice."""
    generator = torch.Generator().manual_seed(3)
    for first in (70, 150, 600):
        span = 4
        anchors = torch.sort(torch.randint(0, first, (1, 2, 9), generator=generator)).values
        carried = anchors.shape[-1]
        for layout, expected_base in ((GroupedDistances(), GroupedDistances().ceiling(span, carried, LIMIT)),
                                      (OwnThenCache(), carried)):
            base = layout.base_on(torch.tensor([first]), span, carried, LIMIT)
            assert int(base) == expected_base == layout.base(first, span, carried, LIMIT)
        grouped = GroupedDistances().place(torch.tensor([first]), torch.tensor([56]), span, LIMIT)(anchors)
        expected = [grouped_target(first - int(a), first, 56, LIMIT) for a in anchors.flatten()]
        assert grouped.flatten().tolist() == expected
        cache = CacheOrder().place(torch.tensor([first]), torch.tensor([carried]), span, LIMIT)(anchors)
        assert cache.flatten().tolist() == list(range(carried)) * 2
        for moved in (False, True):
            own = OwnThenCache().place(torch.tensor([first]), torch.tensor([carried]), span, LIMIT,
                                       moved=moved)(anchors)
            assert torch.equal(own, cache)
        wide = torch.sort(torch.randint(0, first, (1, 2, LIMIT), generator=generator)).values  # cannot compact
        own = OwnThenCache().place(torch.tensor([first]), torch.tensor([56]), span, LIMIT, moved=True)(wide)
        assert torch.equal(own, GroupedDistances().place(torch.tensor([first]), torch.tensor([56]), span,
                                                         LIMIT)(wide))
    inside = OwnThenCache().place(torch.tensor([20]), torch.tensor([20]), 4, LIMIT)(torch.arange(9).view(1, 1, 9))
    assert inside.flatten().tolist() == list(range(9))  # not past the range: every token at its own position


def placed_step_ops(model) -> tuple[int, int]:
    """Compute ops of a steady step of StateKV on ``model`` before the stream was placed away from its own
    positions and after (the default layout, past the range)."""
    from statekv.testing.op_trace import OpTrace

    embed = model.get_input_embeddings()
    prefill = StreamingPrefill(model, StateKV(16), positions="bounded")
    counts = []
    for seed in range(24):
        with OpTrace() as trace:
            prefill.step(inputs_embeds=embed(tokens(4, seed)).detach())
        counts.append((prefill.positions.moved, len(trace.compute)))
    before = [ops for moved, ops in counts[6:] if not moved]
    after = [ops for moved, ops in counts if moved][2:]
    assert before and after and prefill.positions.bases[-1] == 16
    return min(before), max(after)


def test_a_step_past_the_range_places_every_layer_together(tiny_lm):
    """Past the range the default layout places StateKV's carried keys in cache order and rotates them alone (the
    chunk's keys were computed where it is placed), every layer's at once: a placed step costs a fixed number of
    ops more than a step before the stream was placed, and one more a layer (its chunk written beside the placed
    keys), whatever the model's depth."""
    extra = {}
    for layers in (2, 6):
        before, after = placed_step_ops(tiny_lm("qwen2", max_position_embeddings=LIMIT, num_hidden_layers=layers))
        extra[layers] = after - before
    assert extra[6] - extra[2] == 4
    assert extra[2] <= 2 + 13  # the carried keys and placements stacked and rotated; the chunk's rows stacked


@pytest.mark.parametrize("layout, policy, lengths", [
    (OwnThenCache.name, StateKV(16), (4,)),
    (CacheOrder.name, StateKV(16), (4,)),
    (CacheOrder.name, StateKV(16), (3, 5, 7, 4, 6)),
    # layers carrying apart, and steps too wide for the largest carried state to compact (placed the grouped way)
    (OwnThenCache.name, PerLayerBudget(StateKV(16), (10, 58, 16)), (3, 5, 7, 4, 6)),
], ids=["own-then-cache", "cache", "cache, chunks of several lengths", "own-then-cache, uneven layers"])
def test_a_step_placed_where_the_host_settled_it_is_the_step_that_finds_its_place(model, layout, policy, lengths,
                                                                                   monkeypatch):
    """Past the range a cache-order step's places read nothing of the step but its base, which the host planned:
    the step takes them from the host (`BoundedLayout.settled`, made once and kept) instead of finding them on the
    device; every step's hidden states and the saved state are those of the device's own finding, bit for bit,
    resumed part-way too, in fewer ops."""
    from statekv.testing.op_trace import OpTrace

    monkeypatch.setattr("statekv.core.positions.layouts.DEFAULT_LAYOUT", layout)
    embed = model.get_input_embeddings()
    chunks = [embed(tokens(lengths[index % len(lengths)], index)).detach() for index in range(36)]

    def run() -> tuple[list[torch.Tensor], dict, int]:
        prefill = StreamingPrefill(model, policy, positions="bounded")
        hidden, ops = [], 0
        for index, chunk in enumerate(chunks):
            if index == 24:  # resumed from the state saved here
                tensors, metadata = prefill.state_dict()
                prefill = StreamingPrefill(model, policy, positions="bounded")
                prefill.load_state_dict(tensors, metadata)
            with OpTrace() as trace:
                hidden.append(prefill.step(inputs_embeds=chunk))
            ops += len(trace.compute)
        assert prefill.positions.moved and prefill.seen_tokens > LIMIT
        return hidden, prefill.state_dict()[0], ops

    settled, settled_state, settled_ops = run()
    for kind in (CacheOrder, OwnThenCache):
        monkeypatch.setattr(kind, "settled", lambda self, *args, **kwargs: None)
    found, found_state, found_ops = run()
    assert all(torch.equal(a, b) for a, b in zip(settled, found))
    assert settled_state.keys() == found_state.keys()
    assert all(torch.equal(settled_state[name], found_state[name]) for name in settled_state)
    assert settled_ops < found_ops


def test_settled_steps_read_the_rotary_outputs_the_first_of_them_made(model, monkeypatch):
    """A step whose places the host settled runs the decoder at the same positions as every such step before it: the
    rotary module's output is made once per chunk length and read by the later steps (`SettledRotary`), which the
    settled test above shows are bit for bit the steps that make it. Only those positions' memory is read from
    it: the same values elsewhere, another length or rows that differ are made by the module."""
    from statekv.core.positions.rope import SettledRotary

    rotary_class = type(model.model.rotary_emb)
    made = []
    own_forward = rotary_class.forward
    monkeypatch.setattr(rotary_class, "forward", lambda self, x, position_ids: made.append(position_ids.shape)
                        or own_forward(self, x, position_ids))
    prefill = StreamingPrefill(model, StateKV(16), positions="bounded")  # own-then-cache
    embed = model.get_input_embeddings()
    counts = []
    for index in range(30):
        prefill.step(inputs_embeds=embed(tokens(3 + index % 2, index)).detach())
        counts.append(len(made))
    assert prefill.positions.moved and prefill.positions.rotary is not None
    assert counts[-1] - counts[-11] == 0  # steady placed steps of two lengths, each made before: none made again
    assert counts[10] - counts[0] == 10  # inside the range, at its own positions, every step made its own

    module = model.model.rotary_emb
    x = torch.zeros(1, 4, model.config.hidden_size)
    settled = SettledRotary(torch.arange(40, 44))
    assert settled.key(module, x, settled.positions.expand(3, -1)) is not None
    assert settled.key(module, x, settled.positions.unsqueeze(0)) is not None
    for other in (torch.arange(40, 44).expand(1, -1), settled.positions[:3].expand(1, -1),
                  torch.stack([settled.positions, settled.positions])):
        assert settled.key(module, x, other) is None
    rows = torch.arange(40, 48)
    assert SettledRotary(rows[:4]).key(module, x, rows.view(2, 4)) is None  # its memory, but a second row differs
    half = settled.key(module, x.to(torch.bfloat16), settled.positions.unsqueeze(0))
    assert half is not None and half != settled.key(module, x, settled.positions.unsqueeze(0))  # outputs in x's dtype
    plain = settled.key(module, x, settled.positions.unsqueeze(0))
    with torch.inference_mode():  # its outputs could not be saved for backward outside it
        assert settled.key(module, x, settled.positions.unsqueeze(0)) != plain


def test_a_slot_buffer_forgets_its_placing_views_when_pointed_at_other_tensors():
    """`CarriedSlots.carried_placing` keeps its views while the buffer is kept in place; a pool pointing the
    buffer at its own rows (a new ``kv`` or new position rows) drops them, so they neither go stale nor keep the
    tensors they viewed alive."""
    from statekv.core.storage.buffers import CarriedSlots

    slots = CarriedSlots.holding(torch.randn(2, 1, 2, 3, 4), torch.arange(3).expand(1, 2, 3), 2,
                                 torch.arange(3).expand(2, 1, 2, 3))
    keys, placements = slots.carried_placing()
    assert slots.carried_placing()[0] is keys and torch.equal(keys, slots.kv[0, :, :, :3])
    slots.kv = torch.zeros_like(slots.kv)
    assert slots.carried_placing()[0] is not keys and not slots.carried_placing()[0].any()
    kept = slots.carried_placing()[1]
    slots.point_rows(None, torch.full_like(slots.position_rows, 7))
    assert slots.carried_placing()[1] is not kept and (slots.carried_placing()[1] == 7).all()
    assert CarriedSlots.holding(torch.randn(2, 1, 2, 3, 4), torch.arange(3).expand(1, 2, 3), 2).carried_placing() \
        is None


def test_placing_every_layer_at_once_is_placing_each_alone(monkeypatch):
    """`place_carried` stacks the layers carrying as many tokens, at most `PLACED_TOGETHER_BYTES` of keys a stack: one
    stack, several, or each layer alone, every layer's keys are those one layer's rotation gives, bit for bit; a
    layer carrying nothing, or another number of tokens, is placed on its own."""
    from statekv.core.positions import rotation

    generator = torch.Generator().manual_seed(3)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8))
    sizes = [6, 6, 0, 6, 4, 6]
    carried = []
    for size in sizes:
        keys = torch.randn(1, 2, size, 8, generator=generator)
        anchors = torch.sort(torch.randint(0, 500, (1, 2, size), generator=generator)).values
        carried.append((keys, torch.stack([anchors, anchors % 60])) if size else None)
    first, base = torch.tensor([500]), torch.tensor([40])
    placer = GroupedDistances().place(first, base, 4, LIMIT)
    alone = []
    for entry in carried:
        if entry is None:
            alone.append(None)
            continue
        keys, placements = entry
        alone.append(rotate(keys, placer(placements[0]) - placements[1], inv_freq))
    one_layer = carried[0][0].numel() * carried[0][0].element_size()
    for cap in (1 << 20, 2 * one_layer, 1):
        monkeypatch.setattr(rotation, "PLACED_TOGETHER_BYTES", cap)
        placed = rotation.place_carried(placer, inv_freq, carried, chunk_len=4)
        for entry, expected, got in zip(carried, alone, placed):
            if entry is None:
                assert got is None
                continue
            assert got.shape == (1, 2, entry[0].shape[2] + 4, 8)
            assert torch.equal(got[:, :, :entry[0].shape[2]], expected)


def test_a_placed_step_holds_its_placed_keys_for_the_step_only(model):
    """Every layer's placed keys live from the step's start to its commit, not between steps."""
    embed = model.get_input_embeddings()
    prefill = StreamingPrefill(model, StateKV(16), positions="bounded")
    seen = []
    original = prefill.cache.layers[0].stage

    def staging(keys, values):
        seen.append(prefill.cache.transaction.context.placed_keys is not None)
        return original(keys, values)
    prefill.cache.layers[0].stage = staging
    for seed in range(24):
        prefill.step(inputs_embeds=embed(tokens(4, seed)).detach())
    assert prefill.positions.moved and seen[-1]
    assert prefill.cache.transaction.context.placed_keys is None


def test_question_past_the_range_reads_retrieved_frames(model):
    """When the whole cache does not fit the range, a question reads as many steps as fit (or those asked for),
    laid out before the prompt inside the range; too many asked for is refused with one line."""
    prefill = StreamingPrefill(model, StateKV(16), positions="bounded", protect_tokens=9)
    for chunk in split(tokens(100)) * 3:
        prefill.step(input_ids=chunk)
    seen_positions = []
    hook = model.model.rotary_emb.register_forward_hook(lambda m, args, out: seen_positions.append(args[1].clone()))
    try:
        answer = prefill.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    finally:
        hook.remove()
    assert answer.shape == (1, 4) and prefill.last_context == "retrieved"
    assert max(int(p.max()) for p in seen_positions) < LIMIT
    plan = prefill.question_plan(7)
    assert not plan.whole and plan.keep_steps == 1 and plan.start + 7 <= LIMIT
    prefill.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, retrieve=Retrieval(2, keep_tokens=9))
    with pytest.raises(HorizonError, match="retrieve at most"):
        prefill.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, retrieve=Retrieval(40, keep_tokens=9))
    with pytest.raises(HorizonError, match="do not fit"):
        prefill.generate(torch.tensor([[1] * 50]), max_new_tokens=20)


def test_cache_layout_keeps_the_carried_state_in_cache_order(model, monkeypatch):
    """The cache layout: carried keys at consecutive positions right before the chunk (StreamingLLM); full
    attention, whose carried state outgrows the range, is refused with one line."""
    monkeypatch.setattr("statekv.core.positions.layouts.DEFAULT_LAYOUT", CacheOrder.name)
    prefill = StreamingPrefill(model, StateKV(16), positions="bounded")
    for chunk in split(tokens(100)) * 2:
        prefill.step(input_ids=chunk)
    assert max(prefill.positions.bases) == 16 and prefill.positions.layout == CacheOrder()
    full = StreamingPrefill(model, FullAttention(), positions="bounded")
    with pytest.raises(HorizonError, match="grouped layout"):
        for chunk in split(tokens(100)):
            full.step(input_ids=chunk)


def test_the_default_layout_keeps_own_positions_then_the_cache_order_past_the_range(model):
    """The default layout (own-then-cache): the stream's own positions while it fits (so StateKV is exactly
    `stream`), past the range StateKV's carried state in cache order right before its chunk, and full attention,
    whose carried state cannot be, grouped; every position inside the range."""
    assert StreamPositions("bounded", LIMIT).layout == OwnThenCache()
    policy = Recording(16)
    prefill = StreamingPrefill(model, policy, positions="bounded")
    chunks = split(tokens(100)) + split(tokens(100, seed=1))
    for chunk in chunks:
        prefill.step(input_ids=chunk)
    positions, cap = prefill.positions, LIMIT - LIMIT // 8
    own = [s for s, first in enumerate(positions.firsts) if first + positions.spans[s] <= cap]
    assert own and all(positions.bases[s] == positions.firsts[s] for s in own)
    assert positions.bases[-1] == 16 < positions.firsts[-1]  # past the range: the chunk right after 16 carried
    full = StreamingPrefill(model, FullAttention(), positions="bounded")
    for chunk in chunks:
        full.step(input_ids=chunk)
    assert full.positions.bases[-1] == min(cap, LIMIT - full.positions.spans[-1])  # grouped, at its ceiling


def test_bounded_stream_saves_and_resumes_exactly(model):
    """A bounded stream saved past the range resumes with its placements: the continuation is identical."""
    chunks = split(tokens(100)) * 2
    whole = StreamingPrefill(model, StateKV(16), positions="bounded")
    expected = [whole.step(input_ids=chunk) for chunk in chunks]
    first = StreamingPrefill(model, StateKV(16), positions="bounded")
    for chunk in chunks[:15]:
        first.step(input_ids=chunk)
    tensors, metadata = first.state_dict()
    assert metadata["positions"]["mode"] == "bounded" and len(metadata["positions"]["steps"]) == 15
    resumed = StreamingPrefill(model, StateKV(16), positions="bounded")
    resumed.load_state_dict(tensors, metadata)
    for chunk, reference in zip(chunks[15:], expected[15:]):
        assert torch.equal(resumed.step(input_ids=chunk), reference)
    other = StreamingPrefill(model, StateKV(16))
    with pytest.raises(InputError, match="positions=bounded"):
        other.load_state_dict(tensors, metadata)


def test_choosing_positions(model):
    config = model.config
    assert trained_range(config) == LIMIT
    assert choose_positions(None, config, 32) == "stream"
    assert choose_positions(None, config, 100) == "bounded"
    assert choose_positions(None, config, None) == "bounded"
    assert choose_positions("bounded", config, 32) == "bounded"
    with pytest.raises(HorizonError, match="needs a horizon"):
        choose_positions("stream", config, None)
    with pytest.raises(ConfigurationError, match="stream, bounded"):
        StreamingPrefill(model, StateKV(16), positions="relative")
    assert StreamPositions("bounded", LIMIT, GroupedDistances()).export()["layout"] == "grouped"


def test_bounded_steady_steps_past_the_range_are_static_and_sync_free(model):
    """Past the range a steady bounded step is the same ops, shapes and scalars every step, with no host sync:
    the chunk's place is found on the device (what a CUDA graph replays)."""
    from statekv.core.storage.layer_storage import SEGMENT_STEPS
    from statekv.testing.op_trace import OpTrace, device_parts

    prefill = StreamingPrefill(model, StateKV(16), positions="bounded")
    embed = model.get_input_embeddings()
    chunks = [embed(tokens(8, seed)).detach() for seed in range(16)]
    traces = []
    with device_parts():
        for chunk in chunks:
            with OpTrace() as trace:
                prefill.step(inputs_embeds=chunk)
            traces.append(trace)
    assert prefill.seen_tokens > LIMIT and prefill.cache.is_steady()
    steady = traces[10:]  # past the cap of 56 positions: every chunk at the same base
    assert all(trace.device_ops == steady[0].device_ops for trace in steady)  # what a CUDA graph records
    # the whole step too, but where it completes a segment of the retrieval index (host work, once per segment)
    plain = [trace for step, trace in enumerate(traces[10:], start=10) if (step + 1) % SEGMENT_STEPS]
    assert len(plain) < len(steady) and all(trace.ops == plain[0].ops for trace in plain)
    assert all(not trace.syncs for trace in steady)


def test_bounded_streams_stepped_together_end_as_alone(model):
    """Bounded streams share batched forwards past the range, each placing its own chunk and carried keys."""
    from statekv.core.step.batching import StepBatcher, StepRequest

    embed = model.get_input_embeddings()
    chunks = [[embed(tokens(8, 100 * s + i)).detach() for i in range(14)] for s in range(2)]
    alone = []
    for own in chunks:
        prefill = StreamingPrefill(model, StateKV(16), positions="bounded")
        alone.append([prefill.step(inputs_embeds=chunk) for chunk in own])
    together = [StreamingPrefill(model, StateKV(16), positions="bounded") for _ in chunks]
    batcher = StepBatcher()
    for step in range(14):
        hidden = batcher.step([StepRequest(prefill, own[step]) for prefill, own in zip(together, chunks)])
        for s in range(2):
            torch.testing.assert_close(hidden[s], alone[s][step], rtol=1e-4, atol=1e-5)
    assert batcher.batched_steps > 0 and together[0].seen_tokens > LIMIT


def test_a_stream_without_a_horizon_saves_and_resumes_past_the_range(tmp_path, monkeypatch):
    """`qa.stream()` (no horizon: bounded) past a short model's range: saved to a file and resumed from its disk
    tier's file set, each goes on exactly as the stream itself."""
    import numpy as np

    import statekv
    from statekv import Stream
    from statekv.testing import make_tiny_checkpoint

    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 1)
    short = {"max_position_embeddings": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "short", text_config=short,
                                      vision_config={"image_size": 112})
    frames = np.random.default_rng(0).integers(0, 256, (20, 32, 32, 3), dtype=np.uint8)
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=24, offload="disk",
                                         offload_dir=tmp_path / "disk", reserve_tokens=24)
    stream = qa.stream()
    assert stream.horizon is None and stream.prefill.positions.mode == "bounded"
    for frame in frames[:12]:
        stream.push(frame)
    assert stream.tokens > 128
    saved = stream.save(tmp_path / "s.safetensors")
    stream.close()  # one owner at a time
    from_file, from_disk = Stream.load(saved, qa), Stream.load(stream.prefill.disk.folder, qa)
    assert stream.handover == "handed over"  # on the disk tier too: past the range, the cache layout's stream
    whole = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=24, reserve_tokens=24,
                                            bounded_layout="cache").stream()
    for frame in frames[:12]:
        whole.push(frame)
    for frame in frames[12:]:
        for each in (whole, from_file, from_disk):
            each.push(frame)
    expected = whole.ask_tokens("Why?", max_new_tokens=4)
    assert whole.answer_info.context == "retrieved"
    for each in (from_file, from_disk):
        assert each.horizon_frames is None and each.tokens == whole.tokens
        assert torch.equal(each.ask_tokens("Why?", max_new_tokens=4), expected)
    with pytest.raises(InputError, match="positions"):
        Stream.load(saved, qa.with_options(positions="stream"))


def test_a_stream_keeps_a_bounded_record_of_its_steps(monkeypatch):
    """Per-frame times and step records stay bounded however long a stream runs, their totals kept."""
    import statekv.api.stats

    monkeypatch.setattr(statekv.api.stats, "TIMES_KEPT", 4)
    stats = statekv.api.stats.EncodingStats()
    for frame in range(11):
        for times in (stats.frame_seconds, stats.decode_seconds, stats.vision_seconds, stats.language_seconds):
            times.append(0.5 + frame)
        stats.trim()
    assert len(stats.frame_seconds) < 8 and stats.earlier_frames + len(stats.frame_seconds) == 11
    assert stats.seconds == pytest.approx(sum(0.5 + f for f in range(11)))
    assert stats.mean_frame_seconds == pytest.approx(stats.seconds / 11)
    assert statekv.core.stream.prefill.HISTORY_STEPS == 1024
