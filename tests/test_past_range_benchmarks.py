"""The measurement code of the past-the-range causes (benchmarks/retrieval.py, past_range*.py): evidence is
mapped to the frames actually streamed, and each question layout sets the span the engine spreads a question over."""

from __future__ import annotations

import json

import pytest
import torch

from statekv.synthetic.benchmark import make_benchmark

from conftest import benchmark


def test_retrieval_maps_evidence_to_the_frames_streamed(tmp_path):
    retrieval = benchmark("retrieval")
    make_benchmark(tmp_path, videos=1, seed=5, num_frames=40)
    path = tmp_path / "videos" / "v0000.mp4"
    assert retrieval.streamed_stills(path, retrieval.EVERYTHING) == list(range(40))
    kept = retrieval.streamed_stills(path, 10)  # ten of the forty stills, spread over the video
    assert len(kept) == 10 and kept == sorted(kept) and len(set(kept)) == 10
    assert retrieval.evidence_steps(list(range(40)), [3, 17], 1, 1) == [4, 18]
    missing = next(still for still in range(40) if still not in kept)
    assert retrieval.evidence_steps(kept, [missing, kept[2]], 1, 1) == [3]  # the missing one has no step
    entries = [{"evidence_steps": [3], "evidence_streamed": False, "runs": {"r": {"steps": [[3]]}}},
               {"evidence_steps": [5], "evidence_streamed": True, "runs": {"r": {"steps": [[5]]}}}]
    assert retrieval.recall(entries, "r") == [(100.0, 50.0)]  # evidence never streamed is never all retrieved


def test_past_range_maps_each_step_to_the_still_it_holds():
    past_range = benchmark("past_range")
    stills = [None, 0, 1, 2, 3]  # the prompt prefix, then one still per step
    assert past_range.evidence_steps(stills, [2, 3]) == [3, 4]


def test_the_question_layouts_set_the_streams_span():
    layouts = benchmark("past_range_layouts")
    assert layouts.question_span_for(384) == 384  # the engine's own
    for name, span in (("packed", 0), ("spread:96", 96), ("engine", 384)):
        with layouts.question_layout(name):
            assert layouts.question_span_for(384) == span
    with pytest.raises(SystemExit, match="unknown question layout 'spread:x'"):
        with layouts.question_layout("spread:x"):
            pass


def test_the_retrieval_variants_answer_past_the_range(tmp_path, monkeypatch):
    """Before: the variants' wrapper of `ContextPlacing.scoring_turns` kept its old three arguments and tuple, so
    every retrieving question past the range (each variant, the engine's own too) was refused with a TypeError."""
    import numpy as np

    import statekv
    from statekv.core.answering.answer_cache import ContextPlacing
    from statekv.core.answering.retrieval import Retrieval
    from statekv.core.positions.placing import StreamPositions
    from statekv.core.stream.prefill import StreamingPrefill
    from statekv.testing import make_tiny_checkpoint

    short = {"max_position_embeddings": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
             "num_hidden_layers": 1}
    qa = statekv.VideoQA.from_pretrained(make_tiny_checkpoint("internvl", tmp_path / "ckpt", text_config=short,
                                                              vision_config={"image_size": 112}),
                                         method="statekv", reserve_tokens=24, budget=24)
    stream = qa.stream()
    for image in np.random.default_rng(0).integers(0, 256, (14, 32, 32, 3), dtype=np.uint8):
        stream.push(image)
    assert stream.prefill.positions.bounded
    own = stream.ask_tokens("Why?", retrieve=2, max_new_tokens=2), stream.answer_info.read_frames
    for owner, name in ((StreamingPrefill, "question_plan"), (StreamPositions, "question"),
                        (StreamPositions, "context_deltas"), (ContextPlacing, "scoring_turns"),
                        (Retrieval, "candidates")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # put back once the test ends
    for name in ("last_plan", "_past_range_installed"):
        monkeypatch.setattr(StreamingPrefill, name, None, raising=False)
    layouts = benchmark("past_range_layouts")
    layouts.install()
    engine = stream.ask_tokens("Why?", retrieve=2, max_new_tokens=2), stream.answer_info.read_frames
    assert torch.equal(engine[0], own[0]) and engine[1] == own[1]
    for variant in ("stored", "flat", "wide"):
        with layouts.retrieval_variant(variant):
            assert stream.ask_tokens("Why?", retrieve=2, max_new_tokens=2).shape == (1, 2)
    stream.close()


def test_the_held_out_table_pools_the_target_families_with_intervals(tmp_path):
    heldout = benchmark("past_range_heldout")
    assert heldout.tally(tmp_path) is None  # not done: no row
    groups = {family: {"correct": correct, "questions": 12} for family, correct in
              (("needle", 6), ("attribute", 12), ("order", 9), ("first_last", 3), ("count", 1), ("position", 0))}
    (tmp_path / "results.json").write_text(json.dumps({"score": {"groups": {"task_type": groups}}}))
    counts = heldout.tally(tmp_path)
    assert counts["target"] == (30, 48) and counts["count"] == (1, 12)
    assert heldout.cell(counts["target"]) == "62.5 [48, 75]" and heldout.cell((0, 0)) == "–"
    (tmp_path / "answers.rank000.jsonl").write_text("".join(json.dumps({"extra": {"frames": f}}) + "\n"
                                                            for f in (2400, 2400)))
    table = heldout.markdown([("long", "x", counts, heldout.frames_streamed(tmp_path), None)], "note")
    assert "| long | x | 62.5 [48, 75] | 50.0 [25, 75] |" in table and table.rstrip().endswith("| 2400 |")


def test_the_held_out_table_reads_the_longest_set_only_when_it_is_given(tmp_path, capsys):
    heldout = benchmark("past_range_heldout")
    groups = {family: {"correct": 1, "questions": 4} for family in heldout.TARGET + heldout.APART}
    for name in ("short-statekv-r16", "longest-statekv-r16-handover"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"score": {"groups": {"task_type": groups}}}))
        (tmp_path / name / "answers.rank000.jsonl").write_text(json.dumps({"extra": {"frames": 96}}) + "\n")
    sets = ["--long", str(tmp_path / "long"), "--short", str(tmp_path / "short"), "--runs", str(tmp_path),
            "--table-only"]
    heldout.main(sets)
    without = capsys.readouterr().out
    assert "| short | StateKV B=64, inside the range | 25.0" in without and "| longest |" not in without
    heldout.main(sets + ["--longest", str(tmp_path / "longest")])
    with_longest = capsys.readouterr().out
    assert "| longest | StateKV B=64, handover, spread 384 (defaults) | 25.0 [" in with_longest
    assert "`--frames 24000 --videos 4 --seed 4830` (longest)" in with_longest
    with pytest.raises(SystemExit, match="longest-statekv-r16 run on the 24,000-frame set: give its folder"):
        heldout.main(sets + ["--only", "longest-statekv-r16"])
    with pytest.raises(SystemExit, match="longest-statekv-r16-handover run on the 24,000-frame set"):
        heldout.main(sets + ["--only", "longest-statekv-r16-handover"])


def test_further_24000_frame_sets_get_a_row_each_and_one_pooling_them(tmp_path, capsys):
    heldout = benchmark("past_range_heldout")
    for name, correct in (("longest-statekv-r16-handover", 3), ("longest-4840-statekv-r16-handover", 4),
                          ("longest-4850-statekv-r16-handover", 2)):
        groups = {family: {"correct": correct, "questions": 4} for family in heldout.TARGET + heldout.APART}
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"score": {"groups": {"task_type": groups}}}))
        (tmp_path / name / "answers.rank000.jsonl").write_text(json.dumps({"extra": {"frames": 24000}}) + "\n")
    out = tmp_path / "accuracy.md"
    heldout.main(["--long", str(tmp_path / "long"), "--short", str(tmp_path / "short"), "--runs", str(tmp_path),
                  "--table-only", "--longest", str(tmp_path / "longest"), "--more-longest",
                  f"{tmp_path / 'l4840'},4840,4", "--more-longest", f"{tmp_path / 'l4850'},4850,4",
                  "--only", "longest-statekv-r16-handover", "--section", "More", "--out", str(out)])
    table = capsys.readouterr().out
    assert "| longest, seed 4830 | StateKV B=64, handover, spread 384 (defaults) | 75.0 [" in table
    assert "| longest, seed 4840 | StateKV B=64, handover, spread 384 (defaults) | 100.0 [" in table
    assert "| longest, seed 4850 | StateKV B=64, handover, spread 384 (defaults) | 50.0 [" in table
    pooled = f"| longest, seeds 4830, 4840, 4850 pooled | StateKV B=64, handover, spread 384 (defaults) | " \
             f"{heldout.cell((36, 48))} | {heldout.cell((9, 12))} |"
    assert pooled in table and "`--frames 24000 --videos 4 --seed 4850` (longest, seed 4850)" in table
    assert "(long)" not in table and "(short" not in table  # the note names the sets of its rows only
    assert out.read_text().startswith("# Benchmarks\n\n## More\n")
    (tmp_path / "longest-4850-statekv-r16-handover" / "answers.rank000.jsonl").write_text(
        json.dumps({"extra": {"frames": 2000}}) + "\n")
    common = ["--long", str(tmp_path / "long"), "--short", str(tmp_path / "short"), "--runs", str(tmp_path),
              "--table-only", "--more-longest", f"{tmp_path / 'l4840'},4840,4", "--more-longest",
              f"{tmp_path / 'l4850'},4850,4"]
    heldout.main(common + ["--only", "longest-statekv-r16-handover"])  # the further sets alone: no --longest
    alone = capsys.readouterr().out
    assert "| longest, seeds 4840, 4850 pooled |" in alone and alone.rstrip().endswith("| 2000, 24000 |")
    assert "seed 4830" not in alone
    heldout.main(common + ["--only", "short-statekv-r16"])  # a run that is not the defaults': no further rows
    assert "seed 4840" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="seed is given twice"):
        heldout.main(common + ["--longest", str(tmp_path / "longest"), "--longest-seed", "4850"])


def test_encoding_switch_places_own_positions_up_to_the_switch_then_cache_order(tmp_path):
    """The switch benchmark's layout keeps chunks at their own positions up to the switch, then in cache order right
    after the carried state (own-then-cache's rule past the range); a folder that is not a set is refused."""
    switch = benchmark("encoding_switch")
    layout, limit = switch.SwitchAt(own=512), 4096
    assert layout.base(400, 8, 64, limit) == 400  # inside the switch: its own position
    assert layout.base(600, 8, 64, limit) == 64  # past it: right after the 64 carried tokens
    assert switch.layouts.OwnThenCache().base(600, 8, 64, limit) == 600  # the default switches only at the cap
    assert [name for name, *_ in switch.runs([512])] == ["defaults", "switch-512", "prefix", "cache", "handover"]
    with pytest.raises(SystemExit, match="not a synthetic set"):
        switch.main(["--long", str(tmp_path)])


def test_the_squeezed_layout_fits_a_frames_whole_history_in_its_reach_keeping_the_nearest_exact(monkeypatch):
    squeezed = benchmark("squeezed_encoding")
    from statekv.core.positions import layouts
    import statekv.settings.engine as engine_settings

    layout = squeezed.SqueezedDistances(reach=40, near=8)
    first, base = torch.tensor([5000]), torch.tensor([3000])
    anchors = torch.arange(0, 5000, 7)
    places = layout.place(first, base, 4, 4096)(anchors)
    distances = base - places
    assert distances.max() <= 40 and distances.min() >= 1 and (places.diff() >= 0).all()  # in time order
    near = first - anchors <= 8
    assert torch.equal(distances[near], (first - anchors)[near])
    monkeypatch.setattr(layouts, "BOUNDED_LAYOUTS", dict(layouts.BOUNDED_LAYOUTS))
    monkeypatch.setattr(engine_settings, "BOUNDED_LAYOUTS", engine_settings.BOUNDED_LAYOUTS)
    name = squeezed.register(40, 8)
    assert layouts.bounded_layout(name) == layout
    assert engine_settings.EngineSettings(bounded_layout=name).bounded_layout == name
    with pytest.raises(SystemExit, match="--near 40"):
        squeezed.register(40, 40)


def test_the_frame_readout_reads_what_each_object_frame_shows_back_from_its_step(tmp_path):
    """On a video of the length it was trained on, the built-in model's frames name their colour, shape and quarter:
    read from the wrong token or step, they would not."""
    readout = benchmark("frame_readout")
    make_benchmark(tmp_path / "set", videos=1, seed=5, num_frames=96)
    readout.main(["--data", str(tmp_path / "set"), "--method", "full", "--json", str(tmp_path / "out.jsonl")])
    video, totals = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(video["frames"]) == 10  # every appearance of the four objects
    assert all(frame["read"]["colour"] == frame["truth"]["colour"] for frame in video["frames"])
    inside = totals["totals"]["inside"]
    assert inside["colour"] == inside["shape"] == inside["quarter"] == [10, 10]
    assert totals["totals"]["past"]["shape"] == [0, 0]


def test_the_frame_readout_splits_the_frames_where_their_steps_leave_the_range(tmp_path):
    """Full attention places a step away from its own position exactly when the step ends past the range: the
    probe's split is the engine's."""
    import statekv

    readout = benchmark("frame_readout")
    make_benchmark(tmp_path / "set", videos=1, seed=6, num_frames=96)
    readout.main(["--data", str(tmp_path / "set"), "--method", "full", "--range", "300", "--json",
                  str(tmp_path / "out.jsonl")])
    video, totals = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    qa = statekv.VideoQA.from_pretrained("builtin", method="full", positions="bounded")
    qa.adapter.model.config.get_text_config().max_position_embeddings = 300
    stream = qa.stream()
    from statekv.video import open_video

    for frame in open_video(str(tmp_path / "set" / "videos" / "v0000.mp4")).sample(max_fps=1.0):
        stream.push(frame)
    stream.flush()
    positions = stream.prefill.positions
    own = [first == base for first, base in zip(positions.firsts[1:], positions.bases[1:])]  # the frames' steps
    assert 0 < video["inside_until"] < 96 and own == [step < video["inside_until"] for step in range(96)]
    inside, past = totals["totals"]["inside"]["colour"], totals["totals"]["past"]["colour"]
    assert inside[1] + past[1] == 10 and inside[1] == sum(row["frame"] < video["inside_until"]
                                                          for row in video["frames"])


def test_the_frame_readout_refuses_a_stream_handed_over_to_its_successor(tmp_path):
    readout = benchmark("frame_readout")
    make_benchmark(tmp_path / "set", videos=1, seed=6, num_frames=96)
    with pytest.raises(SystemExit, match="handed over"):
        readout.main(["--data", str(tmp_path / "set"), "--method", "statekv", "--range", "300", "--json",
                      str(tmp_path / "out.jsonl")])


def test_the_context_swap_answers_as_the_engine_does_and_swaps_what_it_names(tmp_path):
    """The captured contexts reproduce the engine's answers through the model's own forward, and each swap takes the
    other method's keys and values exactly where its name says: at its layers and its kind of token."""
    swap = benchmark("context_swap")
    make_benchmark(tmp_path / "set", videos=1, seed=5, num_frames=40)
    swap.main(["--set", f"tiny={tmp_path / 'set'},5,1,40", "--runs", str(tmp_path / "runs"), "--out",
               str(tmp_path / "table.md"), "--threads", str(torch.get_num_threads())])  # as it found them
    (video,) = [json.loads(line) for line in (tmp_path / "runs" / "tiny-full-statekv.json").read_text().splitlines()]
    rows = video["questions"]
    assert [row["family"] for row in rows] == list(swap.FAMILIES)
    assert all(row["a_agrees"] and row["b_agrees"] for row in rows)
    assert "`a+b.L2.visual.values`" in (tmp_path / "table.md").read_text()

    starts = torch.tensor([0, 5, 12, 19])  # the prefix, then frames of 7 tokens ending <img> <IMG_CONTEXT> </img>
    kinds = swap.token_kinds(torch.tensor([0, 4, 5, 8, 9, 10, 11, 17, 18]), starts)
    assert kinds["visual"].tolist() == [False] * 5 + [True, False, True, False]
    assert kinds["img_end"].tolist() == [False] * 6 + [True, False, True]
    assert kinds["anchor"].tolist() == [False, False, True, True] + [False] * 5  # tokens 5 and 8: frame 1's text
    limit = 12  # frame 1's step ends at it, inside; frame 2's past it
    kinds = swap.token_kinds(torch.tensor([0, 4, 5, 8, 9, 10, 11, 17, 18]), starts, limit)
    assert kinds["visual.inside"].tolist() == [False] * 5 + [True, False, False, False]
    assert kinds["visual.past"].tolist() == [False] * 7 + [True, False]

    # each layer reads other tokens; every key and value is its own number, so a swap's every entry is checked
    layer_tokens = [torch.tensor([0, 5, 6, 10, 11, 13, 17, 18]), torch.tensor([1, 9, 10, 11, 12, 16, 17, 18]),
                    torch.tensor([2, 3, 4, 5, 10, 15, 17])]
    generator = torch.Generator().manual_seed(0)

    def context():
        return swap.Context([(torch.randn(1, 2, len(t), 4, generator=generator),
                              torch.randn(1, 2, len(t), 4, generator=generator), t) for t in layer_tokens],
                            torch.arange(5), 7)

    a, b = context(), context()
    depth = len(layer_tokens)

    def expected(name):  # per layer and part, which tokens hold b's
        base, rest = (b, name[4:]) if name.startswith("b+a") else (a, name[4:])
        if name in ("a", "b"):
            return {(i, part): torch.full((len(t),), name == "b") for i, t in enumerate(layer_tokens)
                    for part in ("keys", "values")}
        fields = rest.split(".")
        if fields[-1] in ("past", "inside"):  # one kind of token, named in two fields
            fields[-2:] = [".".join(fields[-2:])]
        layers = [int(fields[0][1:])] if fields[0].startswith("L") else range(depth)
        kind = fields[1] if fields[0].startswith("L") and len(fields) > 1 else None if fields[0].startswith("L") \
            else fields[0]
        assert kind is None or kind in swap.token_kinds(layer_tokens[0], starts, limit), name
        parts = (fields[2],) if len(fields) > 2 else ("keys", "values")
        out = {}
        for i, t in enumerate(layer_tokens):
            for part in ("keys", "values"):
                chosen = (torch.ones(len(t), dtype=torch.bool) if kind is None
                          else swap.token_kinds(t, starts, limit)[kind])
                swapped = chosen if i in layers and part in parts else torch.zeros(len(t), dtype=torch.bool)
                out[i, part] = ~swapped if base is b else swapped
        return out

    contexts = swap.swaps(a, b, starts, limit)
    names = {"a", "b", *(f"{d}.L{i}" for d in ("a+b", "b+a") for i in range(depth)),
             *(f"a+b.{kind}" for kind in swap.KINDS),
             *(f"a+b.L{i}.visual{part}" for i in range(depth) for part in ("", ".keys", ".values", ".past", ".inside")),
             "a+b.visual.past", "a+b.visual.inside"}
    assert set(contexts) == names
    for name, context in contexts.items():
        for (i, part), from_b in expected(name).items():
            got = context.layers[i][0 if part == "keys" else 1]
            want = torch.where(from_b[None, None, :, None], b.layers[i][0 if part == "keys" else 1],
                               a.layers[i][0 if part == "keys" else 1])
            assert torch.equal(got, want), (name, i, part)
    assert all(kind.any() for kind in swap.token_kinds(layer_tokens[0], starts).values())  # each kind is there


def test_the_attention_share_splits_each_query_head_s_attention_by_where_each_key_lies():
    """Against a reference written head by head: query head h reads KV head h // 2, its logits scaled by
    1 / sqrt(D), the chunk seen causally, and the keys sorted by their positions at the places' boundaries."""
    share = benchmark("attention_share")
    generator = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(4, 3, 8, generator=generator), torch.randn(2, 8 + 3, 8, generator=generator)
    positions = torch.tensor([[0, 1, 2, 5, 38, 39, 40, 41], [1, 2, 3, 30, 39, 40, 44, 45]])  # [H_kv, K]
    prefix, recent_from = 2, 40
    split = share.shares(queries, keys, -2, positions, prefix=prefix, recent_from=recent_from)
    for head in range(4):
        seen = keys[head // 2, :8 + 2]  # the carried, then the chunk's first two tokens
        weights = torch.softmax(seen @ queries[head, 1] / 8 ** 0.5, -1)
        where = ["prefix" if p < prefix else "recent" if p >= recent_from else "far" for p in positions[head // 2]]
        expected = {place: sum(float(w) for w, at in zip(weights, where) if at == place)
                    for place in ("prefix", "recent", "far")}
        expected["own"] = float(weights[8:].sum())
        for place, value in expected.items():
            assert split[place][head] == pytest.approx(value, abs=1e-6), (head, place)
        assert split["entropy"][head] == pytest.approx(float(-(weights * weights.log()).sum()), abs=1e-5)
    with pytest.raises(ValueError, match="chunk"):
        share.shares(queries, keys, 3, positions, prefix=prefix, recent_from=recent_from)
    with pytest.raises(ValueError, match="7 positions for 8 carried"):
        share.shares(queries, keys, -2, positions[:, 1:], prefix=prefix, recent_from=recent_from)


def run_attention_share(tmp_path, *args: str) -> tuple[dict, dict]:
    share = benchmark("attention_share")
    share.main(["--data", str(tmp_path / "set"), "--json", str(tmp_path / "out.jsonl"), *args])
    video, summary = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    return video, summary


def test_the_attention_share_reads_each_object_frame_s_step_under_full_attention(tmp_path, capsys):
    """Streamed inside the range, every object frame is read at every layer over its whole history, and the trained
    model's heads show what they were trained to do: the counting head (layer 0, head 1) gives the prompt's prefix
    a share, and layer 1's head 1 reads the frame's own tokens at its `</img>` (read at the wrong token or over the
    wrong keys, they would not)."""
    make_benchmark(tmp_path / "set", videos=1, seed=5, num_frames=40)
    video, summary = run_attention_share(tmp_path, "--method", "full")
    assert video["inside_until"] == 40 and len(video["frames"]) == 10
    for row in video["frames"]:
        assert row["carried"] == 3 + 4 * row["frame"]  # the prompt's prefix, then four tokens a frame
        assert set(row) == {"frame", "carried"} | {f"{layer}/{token}" for layer in range(4)
                                                   for token in ("visual", "</img>")}
    means = summary["means"]
    assert means["inside/0/visual"]["prefix"][1] > 0.2 and means["inside/1/</img>"]["own"][1] > 0.95
    assert "inside/1/visual" in capsys.readouterr().out
    for recent, empty in (("0", "recent"), ("100000", "far")):  # nothing is recent, or everything after the prefix
        video, _ = run_attention_share(tmp_path, "--method", "full", "--recent", recent)
        assert all(value == pytest.approx(0.0, abs=1e-6) for row in video["frames"] for key, split in row.items()
                   if "/" in key for value in split[empty])


def test_the_attention_share_splits_frames_at_the_range_and_reads_statekv_s_carried_state(tmp_path):
    """With a declared range of 300 positions, frames whose steps end past it are counted apart; full attention
    attends over every earlier token there, StateKV over its 64 carried ones (cache layout), and the recency
    baseline, whose keys come in ring-slot order, is refused."""
    make_benchmark(tmp_path / "set", videos=1, seed=5, num_frames=96)
    video, summary = run_attention_share(tmp_path, "--method", "full", "--range", "300")
    assert 0 < video["inside_until"] < 96
    assert {"inside/0/visual", "past/0/visual"} <= set(summary["means"])
    assert all(row["carried"] == 3 + 4 * row["frame"] for row in video["frames"])
    video, summary = run_attention_share(tmp_path, "--method", "statekv", "--bounded-layout", "cache", "--range",
                                         "300")
    assert {row["carried"] for row in video["frames"] if row["frame"] > 20} == {64}
    assert "past/1/visual" in summary["means"]
    with pytest.raises(SystemExit):
        run_attention_share(tmp_path, "--method", "recency")
