"""Compute accounting: presets, analytic FLOPs vs FlopCounterMode over the real code paths, curve shapes,
break-even search and the ``statekv flops`` command."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from statekv.errors import ConfigurationError
from statekv.flops import (
    PRESETS,
    LanguageSpec,
    Method,
    ModelSpec,
    VisionSpec,
    break_even,
    from_config,
    get_preset,
    prefill_flops,
    step_flops,
    to_config,
)
from statekv.flops.measured import measure_language, measure_prefill, meta_model

N_STEPS = 4


def _methods(spec: ModelSpec) -> list[Method]:
    tokens = spec.tokens_per_step
    # The budget fills during step 1, so steps 2 and 3 run with a full carried state.
    return [Method("full"), Method("recency", frames=1), Method("statekv", budget=tokens + tokens // 2)]


def _assert_step_agrees(spec, method, step, measured, score="eager"):
    expected = step_flops(spec, method, step, score=score)
    pairs = {
        "vision": (measured.get("vision"), expected["vision"]),
        "projector": (measured.get("projector"), expected["projector"]),
        "lm_linear": (measured["lm_linear"], expected["lm_linear"]),
        "lm_attention+score": (measured["lm_attention"], expected["lm_attention"] + expected["score"]),
    }
    for name, (got, want) in pairs.items():
        if got is not None:
            assert got == pytest.approx(want, rel=0.01), f"{spec.name} {method.label} step {step} {name}"


# -- presets -----------------------------------------------------------------------------------------------

def test_tokens_per_step_follow_each_layout():
    assert {name: spec.tokens_per_step for name, spec in PRESETS.items()} == {
        "internvl3-1b": 259, "internvl3-2b": 259, "internvl3-8b": 259,
        "qwen3-vl-2b": 204, "qwen3-vl-4b": 204, "qwen3-vl-8b": 204, "eagle2.5-8b": 272,
    }
    assert get_preset("qwen3-vl-8b").frames_per_step == 2
    assert get_preset("InternVL3-1B").vision.encoder_tokens == 1025  # 32 x 32 patches + CLS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trips_through_a_transformers_config(name):
    spec = PRESETS[name]
    assert from_config(to_config(spec), name=name) == spec


def test_from_config_reads_a_checkpoint_style_qwen3_vl_config():
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig(  # the values of Qwen3-VL-2B-Instruct's config.json
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           deepstack_visual_indexes=[5, 11, 17]),
        text_config=dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, intermediate_size=6144),
    )
    assert from_config(config, name="qwen3-vl-2b") == PRESETS["qwen3-vl-2b"]


def test_bad_inputs_raise_one_line_configuration_errors():
    with pytest.raises(ConfigurationError, match="unknown model preset"):
        get_preset("internvl9-1b")
    with pytest.raises(ConfigurationError, match="statekv.s budget must be a positive integer"):
        prefill_flops("internvl3-1b", "statekv")
    with pytest.raises(ConfigurationError, match="takes no budget"):
        prefill_flops("internvl3-1b", "full", budget=16)
    with pytest.raises(ConfigurationError, match="unknown method"):
        prefill_flops("internvl3-1b", "sliding")
    with pytest.raises(ConfigurationError, match="model_type"):
        from_config(to_config(PRESETS["internvl3-1b"]).text_config)
    with pytest.raises(ConfigurationError, match="curve must be"):
        break_even(np.ones(3), np.ones(3), curve="total")


# -- analytic == measured ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_analytic_matches_flop_counter_on_the_real_code_path(name):
    """Every component, every step, all three methods: StreamingPrefill + HF vision forward on meta tensors.

    Two LM layers and three ViT layers (all DeepStack mergers still run) keep this fast; FLOPs are additive
    over layers, and the next test runs one model at full depth.
    """
    spec = PRESETS[name].with_layers(language=2, vision=3)
    for method in _methods(spec):
        measured = measure_prefill(spec, method, N_STEPS)
        for step, m in enumerate(measured):
            _assert_step_agrees(spec, method, step, m)
        assert measured[-1]["total"] == pytest.approx(sum(step_flops(spec, method, N_STEPS - 1).values()), rel=0.01)


def test_analytic_matches_flop_counter_at_full_depth():
    spec = get_preset("internvl3-8b")
    method = Method("statekv", budget=300)
    for step, m in enumerate(measure_prefill(spec, method, 3)):
        _assert_step_agrees(spec, method, step, m)


def _tiny_spec() -> ModelSpec:
    vision = VisionSpec(num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=14,
                        image_size=28, class_token=True, projector=(128, 64, 64))
    return ModelSpec("tiny", "internvl", LanguageSpec(64, 2, 4, 2, 16, 96), vision, text_tokens_per_step=7)


@pytest.mark.parametrize(("backend", "max_keys", "score"), [("eager", None, "eager"), ("chunked", None, "eager"),
                                                             ("chunked", 4, "recompute")])
def test_score_pass_convention_matches_each_backend_on_real_tensors(backend, max_keys, score, monkeypatch):
    """Scores from materialised probabilities are free (eager, and chunked while the keys fit one tile); the
    two-pass chunked backend (beyond ``MAX_KEYS`` keys) pays one more QK^T."""
    from transformers import InternVLForConditionalGeneration

    if max_keys is not None:
        monkeypatch.setattr("statekv.core.attention.scored.MAX_KEYS", max_keys)
        monkeypatch.setattr("statekv.core.attention.scored.BLOCK_KEYS", max_keys)

    torch.manual_seed(0)
    spec = _tiny_spec()
    model = InternVLForConditionalGeneration(to_config(spec)).eval()
    # 8 tokens per step: every step has more candidates than the budget, so every step scores explicitly
    # (unscored steps take PyTorch's fused CPU SDPA, which FlopCounterMode cannot count).
    method = Method("statekv", budget=6)
    for step, m in enumerate(measure_language(model, spec, method, N_STEPS, attention=backend)):
        _assert_step_agrees(spec, method, step, m, score=score)
    assert step_flops(spec, method, 3, score="recompute")["score"] > 0


def test_chunked_backend_is_refused_on_meta():
    from statekv.flops.measured import meta_model

    spec = PRESETS["internvl3-1b"].with_layers(1, 1)
    with pytest.raises(ConfigurationError, match="meta"):
        measure_language(meta_model(spec), spec, Method("statekv", budget=300), 1, attention="chunked")


# -- curve shapes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_statekv_is_flat_once_full_and_full_attention_grows_linearly(name):
    spec = PRESETS[name]
    per, tokens, budget = spec.frames_per_step, spec.tokens_per_step, 1024
    n_frames = 60 * per
    full = prefill_flops(spec, "full", n_frames=n_frames)
    state = prefill_flops(spec, "statekv", budget=budget, n_frames=n_frames)
    recency = prefill_flops(spec, "recency", frames=4, n_frames=n_frames)

    full_steps = full.marginal[::per]
    assert np.all(np.diff(full_steps) > 0)
    np.testing.assert_allclose(np.diff(full_steps, 2), 0, atol=1e-6 * full_steps[-1])

    first_full = -(-budget // tokens)  # first step whose history holds at least B tokens
    state_steps = state.marginal[::per]
    assert np.all(state_steps[first_full:] == state_steps[first_full])
    assert np.all(np.diff(state_steps[: first_full + 1]) > 0)
    assert np.all(recency.marginal[4 * per:] == recency.marginal[4 * per])

    for curve in (full, state, recency):
        np.testing.assert_allclose(curve.cumulative, np.cumsum(curve.marginal), rtol=1e-12)
        np.testing.assert_allclose(sum(curve.breakdown.values()), curve.marginal, rtol=1e-12)
        # A step's cost is spread over its frames, so totals are exact at step boundaries.
        assert curve.cumulative[per - 1] == pytest.approx(sum(step_flops(spec, curve.method, 0).values()))


def test_recompute_adds_half_the_attention_once_statekv_must_select():
    eager = prefill_flops("internvl3-2b", "statekv", budget=4096, n_frames=40)
    recompute = prefill_flops("internvl3-2b", "statekv", budget=4096, n_frames=40, score="recompute")
    assert not eager.breakdown["score"].any()
    first_scored = 15  # step 15 is the first with more candidates than the budget: 16 * 259 = 4144 > 4096
    score, attention = recompute.breakdown["score"], recompute.breakdown["lm_attention"]
    assert not score[:first_scored].any()
    np.testing.assert_allclose(score[first_scored:], attention[first_scored:] / 2)
    full = prefill_flops("internvl3-2b", "full", n_frames=40, score="recompute")
    assert not full.breakdown["score"].any()


# -- break-even --------------------------------------------------------------------------------------------

def test_break_even_on_hand_computable_curves():
    n = np.arange(1, 21, dtype=float)
    linear, quadratic = 10 * n, n**2  # totals: 10n vs n^2 (equal at n = 10, so strictly cheaper at 11)
    assert break_even(linear, quadratic) == 11
    assert break_even(quadratic, linear) == 1
    assert break_even(linear, linear) is None
    assert break_even(linear + 1, linear) is None
    assert break_even(linear[:5], quadratic) is None  # only the common horizon is searched
    # Marginals: 10 vs 2n - 1, first strictly cheaper at n = 6.
    assert break_even(np.full(20, 10.0), 2 * n - 1, curve="marginal") == 6


def test_break_even_reads_the_requested_curve_of_prefill_results():
    big = prefill_flops("internvl3-8b", "statekv", budget=16384, n_frames=3600)
    small = prefill_flops("internvl3-1b", "full", n_frames=3600)
    for curve in ("cumulative", "marginal"):
        frame = break_even(big, small, curve=curve)
        a, b = getattr(big, curve), getattr(small, curve)
        assert frame is not None and a[frame - 1] < b[frame - 1] and a[frame - 2] >= b[frame - 2]
    assert break_even(big, small, "marginal") < break_even(big, small, "cumulative")
    assert break_even(big, prefill_flops("internvl3-1b", "full", n_frames=100)) is None


# -- command -----------------------------------------------------------------------------------------------

def test_cli_json_parses_and_holds_curves_and_break_even(capsys):
    from statekv.cli import main

    argv = ["flops", "--json", "--frames", "64", "--models", "internvl3-1b", "qwen3-vl-2b", "internvl3-1b",
            "--budgets", "256", "--recency", "2", "--at", "1", "64"]  # a model named twice is reported once
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    labels = [c["label"] for c in out["curves"]]
    assert labels == ["internvl3-1b Full SA", "internvl3-1b Recency R=2", "internvl3-1b StateKV B=256",
                      "qwen3-vl-2b Full SA", "qwen3-vl-2b Recency R=2", "qwen3-vl-2b StateKV B=256"]
    first = out["curves"][0]["at"]["64"]
    assert first["cumulative"] == pytest.approx(prefill_flops("internvl3-1b", "full", n_frames=64).cumulative[-1])
    assert {p["a"] for p in out["break_even"]} <= set(labels)


def test_a_budget_window_or_frame_named_twice_is_reported_once_in_order(capsys):
    """Before: a repeated budget or window made a row twice (and its break-even rows), a repeated --at frame a
    column twice, and --at's columns came in the order given."""
    from statekv.cli import main

    assert main(["flops", "--frames", "64", "--models", "internvl3-1b", "--budgets", "256", "256", "--recency", "2",
                 "2", "--rekv", "4", "4", "--at", "5", "5", "3"]) == 0
    table = capsys.readouterr().out.split("\n\n")[1]
    assert table.splitlines()[0].split()[-4:] == ["marg@3", "cum@3", "marg@5", "cum@5"]
    assert [line.split("  ")[0] for line in table.splitlines()[2:]] == [
        "internvl3-1b Full SA", "internvl3-1b Recency R=2", "internvl3-1b ReKV R=4", "internvl3-1b StateKV B=256"]


def test_the_question_cost_names_the_frames_a_short_horizon_has(capsys):
    from statekv.cli import main

    for frames, named in (("32", "32 retrieved frames (all there are)"), ("512", "64 retrieved frames")):
        assert main(["flops", "--frames", frames, "--models", "internvl3-1b"]) == 0
        assert f", {named} 0." in capsys.readouterr().out


def test_cli_reports_bad_input_in_one_line(capsys):
    from statekv.cli import main

    assert main(["flops", "--models", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("statekv flops: error: unknown model preset") and "\n" not in err


def test_measuring_past_the_models_rope_says_how_many_steps_fit(capsys):
    """Before: the error advised --max-frames and --positions bounded, flags the flops command does not have."""
    from statekv.cli import main

    assert main(["flops", "--models", "internvl3-8b", "--measure", "400"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("statekv flops: error: 400 steps of 259 tokens take 103600 positions, beyond the model's RoPE (at "
                   "most 32768): measure at most 126 steps")


def test_cli_module_entry_point_and_plots(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "statekv.cli", "flops", "--json", "--frames", "32", "--models", "internvl3-1b",
         "internvl3-8b", "--plot", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    out = json.loads(result.stdout)
    assert sorted(p.rsplit("/", 1)[-1] for p in out["figures"]) == ["compute_accuracy_frontier.png",
                                                                     "flops_vs_frames.png"]
    for path in out["figures"]:
        with open(path, "rb") as png:
            assert png.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_recency_window_is_counted_in_frames_wherever_it_is_used():
    """R = 16 frames is 8 two-frame steps for Qwen3-VL: in the engine's policy, in the analytic FLOPs and in
    the FLOPs measured on the engine itself (one definition, `MethodSettings.window_steps`)."""
    import statekv

    qwen = PRESETS["qwen3-vl-2b"]
    assert qwen.frames_per_step == 2
    assert statekv.make_policy("recency", frames=16, frames_per_step=2) == statekv.Recency(frames=8)
    recency = Method("recency", frames=16)
    assert int(recency.history_tokens(100, qwen.tokens_per_step, qwen.frames_per_step)) == 8 * qwen.tokens_per_step
    spec = qwen.with_layers(language=1, vision=3)
    window = Method("recency", frames=4)  # two steps
    for step, measured in enumerate(measure_language(meta_model(spec), spec, window, 5)):
        _assert_step_agrees(spec, window, step, measured)


def test_rekv_prefill_and_the_cost_of_answering_from_retrieved_frames():
    spec = PRESETS["internvl3-1b"].with_layers(language=2, vision=1)
    rekv = Method("rekv", frames=2)  # 4 sinks and two frames
    for step, measured in enumerate(measure_language(meta_model(spec), spec, rekv, 5)):
        _assert_step_agrees(spec, rekv, step, measured)
    assert int(rekv.history_tokens(10, spec.tokens_per_step)) == 4 + 2 * spec.tokens_per_step
    from statekv.flops.analytic import lm_attention_flops, question_flops

    whole, retrieved = question_flops(spec, 100_000), question_flops(spec, 64 * 259)
    assert whole - retrieved == lm_attention_flops(spec.language, 32 + 16, 100_000 - 64 * 259)


def test_measuring_says_how_far_it_is(capsys, monkeypatch):
    """Before: --measure counted every step of every curve (minutes at real horizons) without a line."""
    from statekv import console
    from statekv.cli import main

    monkeypatch.setattr(console, "PROGRESS_SECONDS", 0.0)
    assert main(["flops", "--frames", "4", "--models", "internvl3-1b", "--budgets", "8", "--recency", "1",
                 "--measure", "2"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" in ")[0] for line in lines] == [f"statekv flops: measuring {done}/6 steps"
                                                          for done in range(1, 6)]
