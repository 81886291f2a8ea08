"""The attention analysis: statistics on hand-built patterns with known answers, against brute force on random
scores, on a tiny decoder through the streaming engine, and end to end on a tiny InternVL checkpoint."""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal

import pytest
import torch

from conftest import CHUNK_LENGTHS, split
from statekv import Recency, StateKV
from statekv.analysis import (
    AnalysisSettings,
    AttentionStatistics,
    RecordScores,
    analyze_attention,
    approximation_errors,
    measure_attention,
    text_steps,
)
from statekv.analysis import statistics as st
from statekv.core import StreamingPrefill

TOTAL = sum(CHUNK_LENGTHS)  # 100 tokens in 12 steps


# ----------------------------------------------------------------------------------------------------
# Hand-built patterns: the scores of every step are written down, so every statistic has a known value.
# ----------------------------------------------------------------------------------------------------

def fold_pattern(pattern, lengths, settings, kv_heads: int = 1) -> dict:
    """Feed ``pattern(step, lengths_so_far) -> scores [N]`` (or ``[H_kv, N]``) to a one-layer accumulator."""
    stats = AttentionStatistics(1, settings)
    for step in range(len(lengths)):
        so_far = tuple(lengths[: step + 1])
        scores = torch.as_tensor(pattern(step, so_far), dtype=torch.float32)
        stats.fold(0, scores.reshape(kv_heads, -1) if scores.dim() == 1 else scores, so_far)
    return stats.result()


LENGTHS = (5, 4, 6, 3, 5, 7, 2, 4)
SETTINGS = AnalysisSettings(budgets=(1, 2, 4, 8, 100), windows=(1, 2, 3, 20), max_distance=4)


def sink(step, lengths):
    """All historical mass on token 0; the step's own tokens get a little (token 0 also tops step 0)."""
    n, t = sum(lengths), lengths[-1]
    scores = torch.zeros(n)
    scores[n - t :] = 0.1
    scores[0] = 5.0
    return scores


def previous_step_only(step, lengths):
    """Historical mass spread evenly over the previous step's tokens."""
    n, t = sum(lengths), lengths[-1]
    scores = torch.zeros(n)
    if step:
        scores[n - t - lengths[-2] : n - t] = 1.0
    scores[n - t :] = 0.5
    return scores


def uniform(step, lengths):
    return torch.ones(sum(lengths))


def mean_over_steps(values):
    return sum(values) / len(values)


def history_steps(lengths):
    """``lengths_so_far`` of every step that has a history."""
    return [tuple(lengths[: s + 1]) for s in range(1, len(lengths))]


def test_pure_sink_is_fully_concentrated_and_far_from_recency():
    r = fold_pattern(sink, LENGTHS, SETTINGS)["layer"]
    assert r["concentration"]["mean"] == pytest.approx([1.0] * 5)
    # The last R steps hold the sink only when they reach back to step 0.
    expected_recent = [mean_over_steps([1.0 if w >= len(so_far) - 1 else 0.0 for so_far in history_steps(LENGTHS)])
                       for w in SETTINGS.windows]
    assert r["recency"]["recent_mass"]["mean"] == pytest.approx(expected_recent)
    assert r["recency"]["selected_mass"]["mean"] == pytest.approx([1.0] * 4)
    assert r["recency"]["gap"]["mean"] == pytest.approx([1 - e for e in expected_recent])
    # Step n puts everything at distance n: columns 1..4 get 1 only from step d, the ">4" column from steps 5+.
    distance = r["distance"]["mean"]
    for d in range(1, 5):
        steps_with_d = [so_far for so_far in history_steps(LENGTHS) if len(so_far) - 1 >= d]
        assert distance[d - 1] == pytest.approx(1 / len(steps_with_d))
    assert distance[4] == pytest.approx(1.0)
    # The sink tops every step's ranking: the top-1 oracle state never changes and is always recalled.
    oracle = r["oracle"]
    for name, value in (("recall", 1.0), ("weighted_recall", 1.0), ("retention", 1.0), ("churn", 0.0)):
        assert oracle[name]["mean"][0] == pytest.approx(value)


def test_pure_recency_pattern():
    r = fold_pattern(previous_step_only, LENGTHS, SETTINGS)["layer"]
    expected = [mean_over_steps([min(b, so_far[-2]) / so_far[-2] for so_far in history_steps(LENGTHS)])
                for b in SETTINGS.budgets]
    assert r["concentration"]["mean"] == pytest.approx(expected)
    assert r["recency"]["recent_mass"]["mean"] == pytest.approx([1.0] * 4)
    assert r["recency"]["gap"]["mean"] == pytest.approx([0.0] * 4, abs=1e-12)
    assert r["distance"]["mean"] == pytest.approx([1.0, 0.0, 0.0, 0.0, 0.0])
    # The historical share of a step: T_prev * 1 over (T_prev * 1 + T * 0.5).
    shares = [so_far[-2] / (so_far[-2] + 0.5 * so_far[-1]) for so_far in history_steps(LENGTHS)]
    assert r["historical_share"]["mean"] == pytest.approx([mean_over_steps(shares)])


def test_uniform_attention():
    r = fold_pattern(uniform, LENGTHS, SETTINGS)["layer"]
    steps = history_steps(LENGTHS)
    history = [sum(so_far[:-1]) for so_far in steps]
    assert r["concentration"]["mean"] == pytest.approx(
        [mean_over_steps([min(b, h) / h for h in history]) for b in SETTINGS.budgets])
    expected_recent = [mean_over_steps([sum(so_far[:-1][-w:]) / sum(so_far[:-1]) for so_far in steps])
                       for w in SETTINGS.windows]
    assert r["recency"]["recent_mass"]["mean"] == pytest.approx(expected_recent)
    assert r["recency"]["gap"]["mean"] == pytest.approx([0.0] * 4, abs=1e-12)  # ties: any B tokens are a top-B
    # Distance d holds the share of that step's tokens in the history.
    for d in range(1, 5):
        shares = [so_far[-1 - d] / sum(so_far[:-1]) for so_far in steps if len(so_far) - 1 >= d]
        assert r["distance"]["mean"][d - 1] == pytest.approx(mean_over_steps(shares))


def test_per_head_rows_keep_each_heads_pattern():
    """Head 0 a pure sink, head 1 a pure recency pattern: per head each keeps its own answer, and the layer row
    is their sum."""
    both = lambda step, lengths: torch.stack([sink(step, lengths), previous_step_only(step, lengths)])
    result = fold_pattern(both, LENGTHS, AnalysisSettings(budgets=(1, 2, 4, 8, 100), windows=(1, 2, 3, 20),
                                                          max_distance=4, per_head=True), kv_heads=2)
    per_head = result["head"]["concentration"]["per_head"][0]
    assert per_head[0] == pytest.approx(fold_pattern(sink, LENGTHS, SETTINGS)["layer"]["concentration"]["mean"])
    assert per_head[1] == pytest.approx(
        fold_pattern(previous_step_only, LENGTHS, SETTINGS)["layer"]["concentration"]["mean"])
    summed = fold_pattern(lambda s, l: sink(s, l) + previous_step_only(s, l), LENGTHS, SETTINGS)
    assert result["layer"]["concentration"]["mean"] == pytest.approx(summed["layer"]["concentration"]["mean"])


def test_newest_first_ranking_turns_the_oracle_over_completely():
    """Scores rising with position: the oracle state of B <= T is the step's own last B tokens, so nothing is
    retained, all of it is new, and the pool (previous state ∪ step) still recalls it fully."""
    lengths = (6, 5, 7, 5)
    r = fold_pattern(lambda step, so_far: torch.arange(1.0, sum(so_far) + 1), lengths,
                     AnalysisSettings(budgets=(1, 2, 5), windows=(1,), max_distance=2))["layer"]["oracle"]
    assert r["retention"]["mean"] == pytest.approx([0.0, 0.0, 0.0])
    assert r["churn"]["mean"] == pytest.approx([1.0, 1.0, 1.0])
    assert r["recall"]["mean"] == pytest.approx([1.0, 1.0, 1.0])


def test_a_sink_that_moves_into_the_history_is_missed_by_the_pool():
    """Step 1's top token is its own; step 2 ranks an old token (never in a top-1 state) first: recall 0."""
    lengths = (3, 3, 3)
    def pattern(step, so_far):
        scores = torch.linspace(0.1, 0.2, sum(so_far))
        scores[{0: 0, 1: 4, 2: 1}[step]] = 9.0
        return scores
    r = fold_pattern(pattern, lengths, AnalysisSettings(budgets=(1,), windows=(1,), max_distance=2))["layer"]["oracle"]
    # Transitions: step 0 -> 1 (top moves from token 0 to token 4, inside step 1: recalled), 1 -> 2 (to token 1).
    assert r["recall"]["mean"] == pytest.approx([0.5])
    assert r["weighted_recall"]["mean"] == pytest.approx([0.5])
    assert r["retention"]["mean"] == pytest.approx([0.0])
    assert r["churn"]["mean"] == pytest.approx([1.0])


def brute_force_step(prev_scores, scores, lengths, budgets, windows):
    """Every statistic of one step from sets and sorted lists (no shared code with the library)."""
    n, t = len(scores), lengths[-1]
    h = n - t
    history = scores[:h]
    total = sum(history)
    ranked_history = sorted(history, reverse=True)
    concentration = [sum(ranked_history[:b]) / total for b in budgets]
    past = lengths[:-1]
    recent, selected = [], []
    for w in windows:
        tokens = sum(past[-w:])
        recent.append(sum(history[h - tokens :]) / total)
        selected.append(sum(ranked_history[:tokens]) / total)
    rank = lambda values: sorted(range(len(values)), key=lambda j: -values[j])
    transition = []
    for b in budgets:
        before = set(rank(prev_scores)[:b])
        after = set(rank(scores)[:b])
        pool = before | set(range(h, n))
        hit = after & pool
        transition.append((len(hit) / len(after), sum(scores[j] for j in hit) / sum(scores[j] for j in after),
                           len(before & after) / len(before), len(after - before) / len(after)))
    return concentration, recent, selected, transition


def test_statistics_match_brute_force_on_random_scores():
    rng = random.Random(0)
    budgets, windows = [1, 3, 7, 15, 40], [1, 2, 5]
    lengths = (4, 7, 3, 6, 5, 8)
    prev = None
    for step in range(len(lengths)):
        so_far = lengths[: step + 1]
        scores = [rng.random() ** 3 for _ in range(sum(so_far))]
        if prev is not None:
            expected = brute_force_step(prev, scores, so_far, budgets, windows)
            rows = torch.tensor([scores], dtype=torch.float64)
            history = st.split_history(rows, so_far)
            cumulative = st.top_mass(history)
            assert st.concentration(cumulative, budgets)[0].tolist() == pytest.approx(expected[0])
            recent, selected, _ = st.recency_comparison(history, cumulative, so_far, windows)
            assert recent[0].tolist() == pytest.approx(expected[1])
            assert selected[0].tolist() == pytest.approx(expected[2])
            moved = st.oracle_transition(rows, so_far, st.oracle_order(torch.tensor([prev]), 40),
                                         st.oracle_order(rows, 40), budgets)
            got = torch.stack([moved.recall, moved.weighted_recall, moved.retention, moved.churn], dim=-1)[0]
            for mine, theirs in zip(got.tolist(), expected[3], strict=True):
                assert mine == pytest.approx(list(theirs))
        prev = scores


def test_settings_are_validated():
    from statekv import ConfigurationError

    for bad in (dict(budgets=()), dict(budgets=(0, 4)), dict(windows=(2.5,)), dict(max_distance=0)):
        with pytest.raises(ConfigurationError):
            AnalysisSettings(**bad)


# ----------------------------------------------------------------------------------------------------
# A tiny decoder streamed through the engine (text chunks of unequal lengths).
# ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lm(tiny_lm):
    return tiny_lm("qwen3")


@pytest.fixture(scope="module")
def text_stream(lm):
    ids = torch.randint(0, lm.config.vocab_size, (1, TOTAL), generator=torch.Generator().manual_seed(3))
    return ids, text_steps(lm, split(ids))


def test_recorded_scores_are_the_one_shot_attention_of_each_chunk(lm, text_stream):
    """What the recording policy hands over equals the model's own eager attention over the whole sequence,
    restricted to each chunk's query rows and summed over them and over each KV group's query heads."""
    ids, steps = text_stream
    recorded = {}
    policy = RecordScores(lambda layer, scores, lengths: recorded.__setitem__((layer, len(lengths)), scores.clone()))
    with StreamingPrefill(lm, policy, attention="eager") as run:
        for step in steps:
            run.step(step.inputs_embeds)
    lm.set_attn_implementation("eager")
    try:
        attentions = lm(input_ids=ids, output_attentions=True).attentions
    finally:
        lm.set_attn_implementation("sdpa")
    kv_heads = lm.config.num_key_value_heads
    ends = torch.tensor(CHUNK_LENGTHS).cumsum(0).tolist()
    for layer, probs in enumerate(attentions):                    # probs [1, Hq, L, L]
        for step, end in enumerate(ends, 1):
            rows = probs[0, :, end - CHUNK_LENGTHS[step - 1] : end, :end].sum(dim=1)   # [Hq, N]
            expected = rows.reshape(kv_heads, -1, end).sum(dim=1)
            torch.testing.assert_close(recorded[(layer, step)], expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def text_statistics(lm, text_stream):
    settings = AnalysisSettings(budgets=(1, 4, 16, 64, TOTAL), windows=(1, 4, 16), max_distance=6, per_head=True)
    return analyze_attention(lm, [text_stream[1]], settings)


def test_concentration_rises_to_one_once_the_budget_covers_the_history(text_statistics):
    for grouping in ("layer", "head"):
        rows = text_statistics[grouping]["concentration"]["per_layer"]
        for curve in rows:
            assert all(a <= b + 1e-12 for a, b in zip(curve, curve[1:], strict=False))
            assert curve[-1] == pytest.approx(1.0, abs=1e-12)
            assert 0 < curve[0] < 1
    assert len(text_statistics["head"]["concentration"]["per_head"][0]) == 2  # qwen3 tiny: 2 KV heads


def test_oracle_is_fully_recalled_when_the_budget_covers_every_token(text_statistics):
    oracle = text_statistics["layer"]["oracle"]
    assert oracle["recall"]["mean"][-1] == pytest.approx(1.0)
    assert oracle["weighted_recall"]["mean"][-1] == pytest.approx(1.0)
    assert oracle["retention"]["mean"][-1] == pytest.approx(1.0)
    # Everything is kept, so the new share is the step's own tokens among all tokens so far.
    lengths = CHUNK_LENGTHS
    churn = mean_over_steps([lengths[s] / sum(lengths[: s + 1]) for s in range(1, len(lengths))])
    assert oracle["churn"]["mean"][-1] == pytest.approx(churn)
    assert text_statistics["steps"] == len(CHUNK_LENGTHS)


def test_statekv_error_vanishes_at_full_budget_and_shrinks_as_the_budget_grows(lm, text_stream):
    budgets = (2, 8, 32, TOTAL)
    errors = approximation_errors(lm, [text_stream[1]], [StateKV(budget=b) for b in budgets]
                                  + [Recency(frames=1), Recency(frames=len(CHUNK_LENGTHS))])
    statekv = [errors[f"statekv B={b}"] for b in budgets]
    for name in ("key_error", "value_error"):
        means = [e[name]["mean"] for e in statekv]
        assert all(later <= earlier for earlier, later in zip(means, means[1:], strict=False)), (name, means)
        assert statekv[-1][name]["per_layer"] == [0.0] * lm.config.num_hidden_layers
        for e in errors.values():  # layer 0's keys and values see only the input embeddings
            assert e[name]["per_layer"][0] == 0.0
    hidden = [e["hidden_error"] for e in statekv]
    assert all(later <= earlier for earlier, later in zip(hidden, hidden[1:], strict=False)), hidden
    assert hidden[0] > 0.05 and hidden[-1] == 0.0
    assert errors[f"recency R={len(CHUNK_LENGTHS)}"]["hidden_error"] == 0.0
    assert errors["recency R=1"]["hidden_error"] > 0.05
    assert errors["recency R=1"]["budget_tokens"] == CHUNK_LENGTHS[-2]
    assert len(errors["recency R=1"]["by_step"]["hidden_error"][0]) == len(CHUNK_LENGTHS)


def test_memory_stays_bounded_as_the_stream_grows(lm, text_stream):
    """What the accumulator holds between steps does not grow with the number of steps (only the current
    step's scores, which the engine hands over and takes back, are as long as the stream)."""
    settings = AnalysisSettings(budgets=(1, 4, 16), windows=(1, 2), max_distance=4, per_head=True)
    steps = text_stream[1][:6]  # 49 tokens
    sizes = []
    for repeats in (1, 3):
        stats = AttentionStatistics(lm.config.num_hidden_layers, settings)
        measure_attention(lm, steps * repeats, stats)
        sizes.append(stats.state_numel())
        assert stats.steps == len(steps) * repeats
    assert sizes[0] == sizes[1] > 0


# ----------------------------------------------------------------------------------------------------
# End to end: a tiny InternVL checkpoint, a synthetic video, the `statekv analyze` command.
# ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_video_model(tmp_path_factory):
    from statekv.testing import make_tiny_checkpoint, write_test_video

    root = tmp_path_factory.mktemp("analysis")
    return make_tiny_checkpoint("internvl", root / "internvl"), write_test_video(root / "clip.mp4", frames=12, fps=4.0)


def test_video_steps_stream_the_adapters_chunks(tiny_video_model):
    from statekv.analysis.video import video_steps
    from statekv.models import load_adapter

    checkpoint, video = tiny_video_model
    adapter = load_adapter(checkpoint)
    steps = video_steps(adapter, video, max_frames=6, max_fps=4.0)
    assert sum(chunk.frames for chunk in steps) == 6
    stats = AttentionStatistics(adapter.model.config.text_config.num_hidden_layers,
                                AnalysisSettings(budgets=(1, 8, 1000), windows=(1, 2), max_distance=4))
    tokens = measure_attention(adapter.model, steps, stats)
    assert tokens == sum(chunk.num_tokens for chunk in steps)
    result = stats.result()["layer"]
    assert result["concentration"]["mean"][-1] == pytest.approx(1.0)
    assert result["oracle"]["recall"]["mean"][-1] == pytest.approx(1.0)


def test_analyze_command_end_to_end(tiny_video_model, tmp_path, capsys):
    checkpoint, video = tiny_video_model
    out = tmp_path / "report"
    code = run_cli(["analyze", "--model", str(checkpoint), str(video), "--frames", "10", "--max-fps", "4",
                 "--budgets", "1", "4", "16", "64", "256", "--recency", "1", "4", "--max-distance", "4",
                 "--error-budgets", "16", "256", "--error-recency", "1", "--out", str(out),
                 "--label", "tiny InternVL", "--note", "random weights"])
    assert code == 0
    report = json.loads((out / "analysis.json").read_text())
    tokens = report["tokens_per_video"][0]
    assert tokens < 256  # so B = 256 covers every token
    stats = report["statistics"]
    assert stats["steps"] == 10 and stats["layers"] == 3
    assert stats["layer"]["concentration"]["mean"][-1] == pytest.approx(1.0)
    assert set(report["errors"]) == {"statekv B=16", "statekv B=256", "recency R=1"}
    assert report["errors"]["statekv B=256"]["hidden_error"] == 0.0
    assert report["errors"]["statekv B=16"]["hidden_error"] > 0.0
    figures = ["analysis_concentration.png", "analysis_oracle.png", "analysis_recency.png",
               "analysis_distance.png", "analysis_error.png"]
    assert report["figures"] == figures
    for name in figures:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "analysis.md").read_text()
    assert "| concentration C(B=256) |" in summary and "0.71 | 0.69 | 0.72" in summary
    assert "> random weights" in summary
    assert not math.isnan(report["statistics"]["layer"]["recency"]["gap"]["mean"][0])
    assert "wrote" in capsys.readouterr().out


def test_analyze_says_how_far_it_is_within_a_video_off_a_terminal(tiny_video_model, tmp_path, capsys,
                                                                   monkeypatch):
    """Before: one line per video and pass, none while a long video's hundreds of steps ran."""
    import statekv.console as console

    monkeypatch.setattr(console, "PROGRESS_SECONDS", 0.0)
    checkpoint, video = tiny_video_model
    assert run_cli(["analyze", "--model", str(checkpoint), str(video), "--frames", "4", "--max-fps", "4",
                    "--budgets", "1", "4", "--recency", "1", "--max-distance", "2", "--error-budgets", "4",
                    "--error-recency", "1", "--out", str(tmp_path / "report")]) == 0
    lines = [line.rsplit(" in ", 1)[0] for line in capsys.readouterr().err.splitlines() if line.startswith("[1/1]")]
    where = f"[1/1] {video}: "
    assert lines[1:] == [*(f"{where}full attention, {done}/4 steps" for done in range(1, 4)),
                         f"{where}2 approximation runs",
                         *(f"{where}approximation runs (full attention, then each), {done}/12 steps"
                           for done in range(1, 12))]


def test_analyze_stopped_keeps_the_videos_it_measured_whole(tiny_video_model, tmp_path, capsys, monkeypatch):
    """Before: a Ctrl-C in the second of two videos wrote nothing: the first video's measurements (hours on a real
    model) were lost. The report of the videos measured whole is written, as a run of those alone writes it."""
    import statekv.analysis.runner as runner

    checkpoint, video = tiny_video_model
    argv = ["analyze", "--model", str(checkpoint), "--frames", "4", "--max-fps", "4", "--budgets", "1", "4",
            "--recency", "1", "--max-distance", "2", "--error-budgets", "4", "--error-recency", "1", "--out"]
    assert run_cli([*argv, str(tmp_path / "alone"), str(video)]) == 0
    measure, calls = runner.measure_attention, []

    def stopped_in_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(*args, **kwargs)

    monkeypatch.setattr(runner, "measure_attention", stopped_in_the_second)
    capsys.readouterr()
    (tmp_path / "stopped").mkdir()
    (tmp_path / "stopped" / "analysis_error.png").write_bytes(b"an earlier run's")
    assert run_cli([*argv, str(tmp_path / "stopped"), str(video), str(video)]) == 130
    assert not (tmp_path / "stopped" / "analysis_error.png").exists()
    said = capsys.readouterr().err
    assert "the 1 video(s) measured whole before the stop are in" in said
    stopped = json.loads((tmp_path / "stopped" / "analysis.json").read_text())
    alone = json.loads((tmp_path / "alone" / "analysis.json").read_text())
    assert stopped["note"] == "stopped after 1 of 2 videos" and stopped["videos"] == [str(video)]
    assert stopped["statistics"] == alone["statistics"] and stopped["errors"] == alone["errors"]
    assert (tmp_path / "stopped" / "analysis.md").read_text().startswith("# Attention analysis")


def test_analyze_stopped_by_an_unreadable_frame_keeps_the_videos_it_measured_whole(tiny_video_model, tmp_path,
                                                                                    capsys):
    """Before: a frame of the second video that cannot be read (found only when it is decoded, midway) ended the run
    with nothing written, the first video's measurements lost; it now stops the run as a Ctrl-C does."""
    from PIL import Image

    checkpoint, video = tiny_video_model
    frames = tmp_path / "frames"
    frames.mkdir()
    for index in range(6):
        Image.new("RGB", (64, 48), (40 * index, 90, 200)).save(frames / f"f{index:02d}.png")
    (frames / "f03.png").write_bytes(b"not a picture")
    out = tmp_path / "report"
    out.mkdir()
    (out / "analysis_concentration.png").write_bytes(b"an earlier run's")
    argv = ["analyze", "--model", str(checkpoint), "--frames", "6", "--max-fps", "4", "--budgets", "1", "4",
            "--recency", "1", "--error-budgets", "4", "--error-recency", "1", "--out", str(out)]
    assert run_cli([*argv, str(video), str(frames)]) == 2
    said = capsys.readouterr().err
    assert "the 1 video(s) measured whole before the error below are in" in said and "f03.png" in said
    kept = json.loads((out / "analysis.json").read_text())
    assert kept["note"] == "stopped after 1 of 2 videos" and kept["videos"] == [str(video)] and kept["errors"]
    assert sorted(path.name for path in out.iterdir()) == ["analysis.json", "analysis.md"]


def test_analyze_writes_no_figure_of_an_earlier_run_and_carries_no_more_tokens_than_the_history(
        tiny_video_model, tmp_path, capsys):
    """Before: a run with --no-errors left an earlier run's error figure beside its report, and the report said a
    StateKV budget larger than the whole video carried the budget's count of tokens."""
    checkpoint, video = tiny_video_model
    out = tmp_path / "report"
    argv = ["analyze", "--model", str(checkpoint), str(video), "--frames", "4", "--max-fps", "4", "--recency", "1",
            "--out", str(out)]
    assert run_cli([*argv, "--budgets", "1", "100000"]) == 0
    report = json.loads((out / "analysis.json").read_text())
    history = report["tokens_per_video"][0] * 3 // 4  # four steps of one length: the three before the last
    assert report["errors"]["statekv B=100000"]["budget_tokens"] == history
    assert report["errors"]["statekv B=1"]["budget_tokens"] == 1
    assert f"| statekv B=100000 | {history} |" in (out / "analysis.md").read_text()
    assert (out / "analysis_error.png").exists()
    assert run_cli([*argv, "--budgets", "1", "--no-errors"]) == 0
    assert not (out / "analysis_error.png").exists() and (out / "analysis_concentration.png").exists()


def test_analyze_keeps_no_more_distances_apart_than_frames_sampled(tiny_video_model, tmp_path):
    """Before: --max-distance 1000000000 allocated a column per distance for every layer and step (the process was
    killed for memory); no two of the frames sampled are farther apart than their count."""
    checkpoint, video = tiny_video_model
    out = tmp_path / "report"
    assert run_cli(["analyze", "--model", str(checkpoint), str(video), "--frames", "3", "--max-fps", "4",
                    "--no-errors", "--max-distance", "1000000000", "--out", str(out)]) == 0
    statistics = json.loads((out / "analysis.json").read_text())["statistics"]
    assert statistics["max_distance"] == 3 and statistics["distance_labels"] == ["1", "2", "3", ">3"]


def run_cli(argv: list[str]) -> int:
    """``statekv`` with ``argv``; usage errors end in SystemExit (argparse), input errors in a return code."""
    from statekv.cli import main

    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "0"], "--budgets: expected a positive integer, got '0'"),
    (["--max-distance", "-3"], "--max-distance: expected a positive integer, got '-3'"),
    (["--frames", "many"], "--frames: expected a positive integer, got 'many'"),
    (["--error-recency", "0"], "--error-recency: expected a positive integer, got '0'"),
])
def test_analyze_command_rejects_bad_settings_in_one_line(tiny_video_model, tmp_path, capsys, argv, message):
    checkpoint, video = tiny_video_model
    assert run_cli(["analyze", "--model", str(checkpoint), str(video), "--out", str(tmp_path), *argv]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error


def test_analyze_command_reports_a_missing_video_before_loading_the_model(tmp_path, capsys):
    assert run_cli(["analyze", "--model", str(tmp_path / "nowhere"), str(tmp_path / "missing.mp4"),
                    "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert "missing.mp4" in error and "no such file" in error and "\n" not in error


def test_analyze_stopped_in_its_first_video_says_nothing_was_written_and_whose_analysis_is_there(
        tiny_video_model, tmp_path, capsys, monkeypatch):
    """Before: a stop before any video was measured whole said only "stopped", beside an earlier run's complete
    analysis in --out that read as this run's."""
    import signal

    import statekv.analysis.runner as runner
    from statekv.console import Stopped

    checkpoint, video = tiny_video_model
    out = tmp_path / "report"
    argv = ["analyze", "--model", str(checkpoint), "--frames", "4", "--max-fps", "4", "--budgets", "1", "4",
            "--recency", "1", "--max-distance", "2", "--no-errors", "--out", str(out)]
    assert run_cli([*argv, str(video)]) == 0
    earlier = (out / "analysis.json").read_bytes()

    def stopped(*args, **kwargs):
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(runner, "measure_attention", stopped)
    capsys.readouterr()
    assert run_cli([*argv, str(video), str(video)]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"statekv analyze: stopped by SIGTERM; no video was measured whole, so nothing was written to {out} "
        "(the analysis in it is an earlier run's)")
    assert (out / "analysis.json").read_bytes() == earlier


def test_analyze_stopped_while_drawing_its_figures_keeps_a_report_naming_none(tiny_video_model, tmp_path, capsys,
                                                                             monkeypatch):
    """Before: a stop while the figures were drawn left analysis.json and analysis.md naming figures that were
    never written, and the stop said nothing of what was kept."""
    import signal

    import statekv.analysis.plots as plots
    from statekv.console import Stopped

    def stopped(document, out):
        (out / "analysis_concentration.png").write_bytes(b"half a figure")
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(plots, "plot_all", stopped)
    checkpoint, video = tiny_video_model
    out = tmp_path / "report"
    assert run_cli(["analyze", "--model", str(checkpoint), str(video), "--frames", "4", "--max-fps", "4", "--budgets",
                    "1", "4", "--recency", "1", "--max-distance", "2", "--no-errors", "--out", str(out)]) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"statekv analyze: stopped by SIGTERM; {out / 'analysis.json'} and {out / 'analysis.md'} hold the analysis "
        "of every video (no figures)")
    assert json.loads((out / "analysis.json").read_text())["figures"] == []
    assert ".png" not in (out / "analysis.md").read_text()
    assert sorted(path.name for path in out.iterdir()) == ["analysis.json", "analysis.md"]


@pytest.mark.parametrize("where", ["drawing", "measuring"])
def test_analyze_stopped_where_a_library_swallows_the_ctrl_c_ends_as_stopped(tiny_video_model, tmp_path, capsys,
                                                                           monkeypatch, where):
    """Before: a Ctrl-C matplotlib clears as it draws (1 savefig in 12) was lost (exit 0, every figure written); one
    cleared as the first of two videos was measured waited for the second. Each figure's and video's end raises it."""
    import statekv.analysis.runner as runner
    from matplotlib.figure import Figure
    checkpoint, video = tiny_video_model
    owner, name = (Figure, "savefig") if where == "drawing" else (runner, "measure_attention")
    called, out = getattr(owner, name), tmp_path / "report"
    def swallowing(*args, **kwargs):  # a Ctrl-C lands while the library runs, and the library clears it
        with contextlib.suppress(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        return called(*args, **kwargs)

    monkeypatch.setattr(owner, name, swallowing)
    argv = ["analyze", "--model", str(checkpoint), str(video), *([str(video)] if where == "measuring" else []),
            "--frames", "4", "--max-fps", "4", "--budgets", "1", "--recency", "1", "--no-errors", "--out", str(out)]
    assert run_cli(argv) == 130 and "statekv analyze: interrupted" in capsys.readouterr().err
    document = json.loads((out / "analysis.json").read_text())
    assert not document.get("figures") and not list(out.glob("*.png"))
    assert len(document["videos"]) == 1 and (where == "drawing" or "stopped after 1 of 2" in document["note"])
