"""What makes watches cheap changes nothing they answer or carry (docs/engine.md, "Standing questions"): the
drafts an evaluation checks (`statekv.core.watching.drafts`), the additive mask of its attention, and the rotation
steering places its questions' queries with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import statekv
import statekv.core.answering.rows as rows_module
import statekv.core.watching.standing as standing_module
from statekv.core.answering.rows import masked_attention, own_mask
from statekv.core.rules.steering import QuestionGuide
from statekv.core.watching.drafts import EARLIER_ANSWERS, EXTRA_NODES, draft_tree, kept_answers
from statekv.core.watching.standing import StandingQuestion

from conftest import random_frames

END = 2


def test_a_draft_tree_shares_beginnings_and_reads_off_the_greedy_answer():
    tree = draft_tree([5, 7, END], [[5, 9, END], [6, END]], [8, 5], {END}, longest=16)
    assert tree.tokens == [5, 7, 9, 6, 8] and tree.parents == [-1, 0, 0, -1, -1] and tree.depths == [1, 2, 2, 1, 1]
    sees = tree.reads()
    assert sees[1].tolist() == [True, True, False, False, False] and sees[3].tolist() == [False] * 3 + [True, False]
    # told: the token after the prompt, then after each node in order
    assert tree.walk([5, 4, 1, 1, 1, 1], {END}, 16) == ([5, 4], [0])  # 5, then 4: no node holds it
    assert tree.walk([5, 9, 1, END, 1, 1], {END}, 16) == ([5, 9, END], [0, 2])  # 5, 9: found whole
    assert tree.walk([5, 7, 1, 1, 1, 1], {END}, 16) == ([5, 7, 1], [0, 1])
    assert tree.walk([6, 1, 1, 1, END, 1], {END}, 16) == ([6, END], [3])  # an earlier answer
    assert tree.walk([8, 1, 1, 1, 1, 3], {END}, 16) == ([8, 3], [4])  # a runner-up's next token
    assert tree.walk([5, 7, 1, 1, 1, 1], {END}, 2) == ([5, 7], [0])  # at the longest answer
    assert tree.walk([END, 1, 1, 1, 1, 1], {END}, 16) == ([END], [])


def test_a_draft_tree_bounds_what_the_alternatives_add():
    tree = draft_tree([11, 12, 13, END], [[14, 15, 16, 17], [18]], [19, 10], {END}, longest=16)
    assert tree.tokens[:3] == [11, 12, 13] and len(tree) == 3 + EXTRA_NODES  # the latest answer whole, then a few
    assert len(draft_tree([11, 12, 13, 14], [], [], {END}, longest=3)) == 2  # no node past the longest answer's
    assert len(draft_tree([END], [], [], {END}, longest=4)) == 0 and not draft_tree([], [], [], set(), 1)


def remember(earlier: list[torch.Tensor], previous: torch.Tensor, answer: torch.Tensor) -> list[torch.Tensor]:
    return kept_answers([previous, *earlier], [each.tolist() for each in (previous, *earlier)], answer.tolist())


def test_earlier_answers_are_remembered_latest_first_each_once():
    a, b, c = (torch.tensor([token, END]) for token in (4, 5, 6))
    assert remember([], torch.empty(0, dtype=torch.long), a) == []
    assert remember([], a, a) == []  # unchanged: nothing new to remember
    kept = remember(remember([], a, b), b, c)
    assert [int(each[0]) for each in kept] == [5, 4]
    assert [int(each[0]) for each in remember(kept, c, a)] == [6, 5]  # never the answer itself
    many = [torch.tensor([token]) for token in range(10)]
    assert len(remember(many, torch.tensor([99]), torch.tensor([98]))) == EARLIER_ANSWERS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("among", [False, True])
@pytest.mark.parametrize("once", [False, True])
def test_the_evaluation_mask_is_the_boolean_one_sdpa_would_read(among, dtype, once):
    """Exactly SDPA over the boolean mask (what `masked_attention` handed it before it built the additive one), in
    each dtype: causal or a draft tree among the forward's tokens, a padding query reading the valid keys and
    itself, a draft tree after padding; with the part over the forward's own tokens made once (`own_mask`, as a
    `RowCache` makes it for every layer of a forward) or by each call."""
    generator = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, length, total, dim = 3, 4, 2, 6, 20, 8
    q = torch.randn(rows, heads, length, dim, generator=generator).to(dtype)
    keys, values = (torch.randn(rows, kv_heads, total, dim, generator=generator).to(dtype) for _ in range(2))
    valid = torch.rand(rows, kv_heads, total, generator=generator) > 0.3
    valid[:, :, total - length:] = True
    valid[0, :, total - length:total - length + 2] = False  # two padding tokens
    reads = torch.ones(length, length, dtype=torch.bool).tril().expand(rows, -1, -1).clone()
    if among:
        reads[0, 5, 4] = reads[1, 4, 3] = reads[2, 5, 4] = False  # draft tokens that do not read a sibling
    allowed = valid.repeat_interleave(heads // kv_heads, 1)[:, :, None, :].expand(-1, -1, length, -1).clone()
    allowed[..., total - length:] &= reads[:, None]
    own = torch.arange(length)
    allowed[:, :, own, total - length + own] = True
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=0.3, enable_gqa=True)
    made = own_mask(valid[:, 0, total - length:], reads if among else None, rows, length, dtype,
                    torch.device("cpu")) if once else None
    got = masked_attention(q, keys, values, valid, 0.3, among=reads if among else None, own=made)
    assert not got.isnan().any() and torch.equal(got, expected.transpose(1, 2))


def test_a_row_cache_forgets_the_columns_named_and_no_others():
    """`RowCache.forget` with columns that are not one run: exactly those appended tokens of that row are read no
    more, at every layer."""
    from statekv.core.answering.rows import LayerContext, RowCache, RowContexts

    context = LayerContext(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.ones(1, 2, 3, dtype=torch.bool))
    cache = RowCache([], room=8, layers=2)
    for layer in cache.layers:
        layer.rows = RowContexts([context, context], room=8)
        layer.rows.append(torch.ones(2, 2, 6, 4), torch.ones(2, 2, 6, 4))
    cache.forget(1, [0, 2, 5])
    for layer in cache.layers:
        appended = layer.rows.valid[:, :, 3:9]
        assert appended[0].all()
        assert appended[1, :, [1, 3, 4]].all() and not appended[1, :, [0, 2, 5]].any()


def test_steering_places_the_questions_queries_with_ropes_own_rotation_exactly():
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, rotary, layers = 4, 2, 16, 12, 3
    frequencies = torch.rand(rotary // 2, generator=generator)
    questions = [StandingQuestion(torch.zeros(1, length, dtype=torch.long), frequencies,
                                  [torch.randn(1, heads, length, dim, generator=generator) for _ in range(layers)],
                                  start=40) for length in (5, 3)]
    guide = QuestionGuide()
    for question in questions:
        guide.add(question)
    positions = SimpleNamespace(bounded=False, still=True)
    cache = SimpleNamespace(positions=positions, seen_device=torch.tensor(57), step_index=7)
    (placed, _), = guide.placed(cache, kv_heads, torch.device("cpu"), 2, 0.3)
    angles = (torch.tensor([57 + 2]) - 40).float() * frequencies
    cos, sin, half = angles.cos() * 0.3, angles.sin() * 0.3, rotary // 2
    turn = torch.zeros(dim, dim)
    for i in range(half):  # q' = q cos + rotate_half(q) sin, as a matrix on the right of the queries
        turn[i, i], turn[half + i, half + i], turn[half + i, i], turn[i, half + i] = cos[i], cos[i], -sin[i], sin[i]
    for i in range(rotary, dim):
        turn[i, i] = 0.3
    stacked = torch.cat([torch.cat([q.queries[layer] for q in questions], 2).reshape(1, kv_heads, -1, dim)
                         for layer in range(layers)])
    assert torch.equal(placed, stacked @ turn)


def test_drafts_change_no_answer_nor_what_steering_carries_and_save_forwards(checkpoint, monkeypatch):
    """A tiny random model's answers of four tokens, every row of a batch at its own pace, with drafts and with
    the latest answer as the only one (the evaluation before drafts): the same events and carried state, in
    fewer forwards."""
    # one engine: these frames pass the tiny model's range, and a successor's replay steers by the watches' last
    # queries, so the answers after it (and what the drafts save) are another stream's
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=12, bounded_layout="own-then-cache")
    frames = random_frames(24)
    forwards = []
    attention = rows_module.masked_attention

    def counted(q, keys, values, valid, scale, **kwargs):
        forwards[-1] += 1
        return attention(q, keys, values, valid, scale, **kwargs)

    def latest_only(latest, earlier, runners_up, ends, longest):
        return draft_tree(latest, [], [], ends, longest)

    monkeypatch.setattr(rows_module, "masked_attention", counted)
    runs = []
    for tree in (draft_tree, latest_only):
        monkeypatch.setattr(standing_module, "draft_tree", tree)
        forwards.append(0)
        stream = qa.stream(max_fps=1)
        stream.push(frames[0], 0.0)
        watches = [stream.watch(question, every=1, max_new_tokens=4) for question in ("Why?", "What is it?")]
        for index in range(1, len(frames)):
            stream.push(frames[index], float(index))
        layers = len(stream.prefill.cache.layers)
        runs.append(([w.events for w in watches],
                     [stream.prefill.carried_positions(layer).clone() for layer in range(layers)]))
        stream.close()
        kept = [w.standing for w in watches]
        assert not any(t.is_inference() for q in kept for t in (*q.queries, q.answer, *q.earlier))  # all ordinary
    (events, carried), (alone_events, alone_carried) = runs
    assert events == alone_events and sum(len(each) for each in events) > 20
    assert all(torch.equal(a, b) for a, b in zip(carried, alone_carried))
    assert forwards[0] < forwards[1]
