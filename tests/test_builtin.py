"""The built-in model: shipped weights load through from_pretrained and answer held-out questions; training
lays prompts out exactly as streaming does, and resumes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer, InternVLForConditionalGeneration

import statekv
from statekv.builtin import WEIGHTS_DIR, builtin_checkpoint
from statekv.settings.options import BUILTIN_BUDGET, BUILTIN_RECIPE_FILE, is_builtin_kind
from statekv.builtin.architecture import build_tokenizer
from statekv.builtin.batches import BatchMaker, FrameBank, frame_words, forward_targets, still_words
from statekv.builtin.lean import keeping_maps
from statekv.builtin.long_range import DENSE_FAMILIES, UNTRAINED, LongRange, dense_batch, draw_batch, stream_batch
from statekv.builtin.training import LOG_FILE, STATE_FILE, Recipe, train
from statekv.core.positions.layouts import GroupedDistances, grouped_places
from statekv.errors import ConfigurationError
from statekv.eval.runner import EvalConfig, run_evaluation
from statekv.synthetic.benchmark import make_benchmark, write_video
from statekv.synthetic.plans import plan_video
from statekv.synthetic.prompts import question_prompt
from statekv.synthetic.scenes import COLOURS, SHAPES
from statekv.synthetic.seeds import TRAINING_SEEDS, training_rng
from statekv.synthetic.tasks import FAMILIES, ask_all

HELD_OUT = dict(videos=8, seed=424242)  # an evaluation seed: never trained on


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_pretrained("builtin", method="full")


def test_shipped_weights_are_a_small_internvl3_loaded_by_from_pretrained(qa):
    folder = builtin_checkpoint()
    assert folder == WEIGHTS_DIR and (folder / "model.safetensors").stat().st_size <= 20 * 2**20
    model = AutoModelForImageTextToText.from_pretrained(folder)
    assert isinstance(model, InternVLForConditionalGeneration) and model.config.model_type == "internvl"
    assert qa.adapter.family == "internvl" and qa.adapter.layout == "chat"  # the layout it was trained on
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "Frame7: What shape was the red object?\nA. circle\nB. cross"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    for word in [*COLOURS, *SHAPES, "video", "shown", "quarter"]:  # the questions' words are single tokens
        assert len(tokenizer.tokenize(" " + word)) == 1, word


def test_the_built_in_model_carries_its_own_budget_unless_one_is_given(qa):
    assert BUILTIN_BUDGET == 64
    assert statekv.VideoQA.from_pretrained("builtin").policy == statekv.StateKV(budget=BUILTIN_BUDGET)
    assert qa.with_options(method="statekv").policy == statekv.StateKV(budget=BUILTIN_BUDGET)
    assert qa.with_options(method="statekv", budget=4096).policy == statekv.StateKV(budget=4096)
    config = EvalConfig.for_model("synthetic", "builtin", "data", "runs/x", method="statekv")
    assert config.options.budget == BUILTIN_BUDGET


def test_a_misspelt_option_is_refused_naming_the_options_only(qa):
    """The known options listed are ModelOptions' fields, never its class variables (SETTINGS, ENGINE); the
    closest is named (before: listed among 26, unnamed)."""
    with pytest.raises(ConfigurationError, match="unknown option 'bugdet': did you mean budget[?] not a statekv "
                       "option") as refused:
        statekv.VideoQA.from_pretrained("builtin", bugdet=3)
    with pytest.raises(ConfigurationError, match="unknown option 'SETTINGS' for with_options") as changed:
        qa.with_options(SETTINGS=())
    for message in (str(refused.value), str(changed.value)):
        listed = message.split("(")[1].split(")")[0] if "(" in message else message.split("known: ")[1]
        assert "budget" in listed.split(", ") and "SETTINGS" not in listed and "ENGINE" not in listed


def test_shipped_weights_answer_held_out_questions_under_full_attention(qa, tmp_path):
    data = tmp_path / "heldout"
    make_benchmark(data, **HELD_OUT)
    summary = run_evaluation(EvalConfig.for_model("synthetic", "builtin", data, tmp_path / "run", method="full",
                                        progress=False), qa=qa)
    overall = summary["score"]["overall"]
    assert overall["questions"] == 8 * len(FAMILIES) and overall["unparsable"] == 0
    assert overall["accuracy"] > 80, summary["score"]["groups"]["task_type"]


def test_training_batches_equal_the_streamed_prompt(tmp_path):
    """The one-shot batched forward used for training gives the logits statekv's streamed full attention gives."""
    qa = statekv.VideoQA.from_pretrained("builtin", method="full")
    adapter, model = qa.adapter, qa.adapter.model
    maker, bank = BatchMaker(adapter), FrameBank(adapter)
    batch = maker.make(np.random.default_rng(5), videos=1, num_frames=20)
    model.set_attn_implementation("eager")  # as in training, which reads attention probabilities
    with torch.no_grad():
        logits, _, word_logits, evidence_mass, counting_loss = forward_targets(model, bank, batch)
    assert word_logits.shape[0] == evidence_mass.shape[0] == len(FAMILIES)
    assert bool(((evidence_mass > 0) & (evidence_mass <= 1 + 1e-5)).all()) and float(counting_loss) > 0
    rng = np.random.default_rng(5)
    plan = plan_video(rng, 20)
    specs = ask_all(plan, rng)
    with qa.encode(write_video(plan, tmp_path / "video.mp4")) as video:  # the file, as evaluation reads it
        assert video.tokens == batch.video_ids.shape[1]
        for row, spec in enumerate(specs):
            prompt = adapter.question_ids(question_prompt(spec.question, spec.options), video.state)
            with torch.no_grad():
                streamed = model(input_ids=prompt, past_key_values=video.prefill.detailed_cache).logits[0, -1]
            torch.testing.assert_close(streamed, logits[row, 0], atol=2e-4, rtol=1e-4)
            answer = video.ask_tokens(question_prompt(spec.question, spec.options), max_new_tokens=1)
            assert int(answer[0, 0]) == int(logits[row, 0].argmax())


def test_training_runs_and_resumes(tmp_path):
    recipe = Recipe(videos_per_batch=1, curriculum=((0, 1), (3, 2)), warmup_steps=1, log_every=1,
                    checkpoint_every=1, long_range=LongRange(steps=2, frames=(6,), stream_frames=300, span=60))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert not train(recipe, tmp_path, stop_after=2).exists()  # stopped half way: no model yet
        assert torch.get_num_threads() == 1  # the caller's thread back (trained with two)
    finally:
        torch.set_num_threads(threads)
    assert torch.load(tmp_path / STATE_FILE, weights_only=True)["step"] == 2
    assert float(torch.tensor([1e-310], dtype=torch.float64) * 1) > 0  # subnormals no longer flushed after it
    model_dir = train(recipe, tmp_path)
    lines = [json.loads(line) for line in (tmp_path / LOG_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert lines[0]["accuracy"] is None and lines[0]["family_accuracy"] == {}  # a vision step: stills only
    assert set(lines[2]["family_accuracy"]) == set(FAMILIES) and lines[2]["loss"] > 0
    assert [line["frames"] for line in lines[1:]] == [3, 3, "long-range", "long-range"]
    moments = torch.load(tmp_path / STATE_FILE, weights_only=True)["optimizer"]["state"]
    assert {int(state["step"]) for state in moments.values()} == {2}  # the phase's optimiser started afresh
    assert AutoModelForImageTextToText.from_pretrained(model_dir).config.image_seq_length == 1
    saved = json.loads((model_dir / BUILTIN_RECIPE_FILE).read_text())
    assert saved["curriculum"] == [[0, 1], [3, 2]] and Recipe.from_dict(saved) == recipe


def test_the_long_range_phase_starts_from_given_weights_at_its_own_learning_rate(tmp_path):
    """``init``: the curriculum's weights, then only the long-range phase's steps, at its own learning rate."""
    recipe = Recipe(videos_per_batch=1, curriculum=((0, 1), (16, 2)), log_every=1,
                    long_range=LongRange(steps=1, frames=(6,), stream_frames=300, span=60))
    model_dir = train(recipe, tmp_path / "run", init=WEIGHTS_DIR)
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / LOG_FILE).read_text().splitlines()] == [4]
    assert recipe.learning_rate_at(3) == recipe.long_range.learning_rate
    before = InternVLForConditionalGeneration.from_pretrained(WEIGHTS_DIR).state_dict()
    after = InternVLForConditionalGeneration.from_pretrained(model_dir).state_dict()
    moved = [name for name in before if not torch.equal(before[name], after[name])]
    assert 0 < len(moved)  # one Adam step from a fresh state moves every weight by about the learning rate
    largest = max(float((before[name] - after[name]).abs().max()) for name in moved)
    assert largest <= 2 * recipe.long_range.learning_rate


def test_a_stream_batch_names_frames_by_their_second_and_places_them_in_the_streams_quarters():
    adapter = statekv.VideoQA.from_pretrained("builtin", method="full").adapter
    maker = BatchMaker(adapter)
    times, length = (3, 100, 650, 1300, 1900, 2300), 2400
    batch = maker.make(np.random.default_rng(7), 1, len(times), times=times, length=length)
    text = adapter.tokenizer.decode(batch.video_ids[0])
    assert "Frame4: " in text and "\nFrame101: " in text and "Frame2301: " in text and "Frame1: " not in text
    prefix = adapter.tokenizer.decode(adapter.prefix(adapter.start(len(times))).input_ids[0])
    assert text.startswith(prefix + "Frame4: ")  # the first frame shown has no line break of its own
    quarters = [maker.adapter.tokenizer.decode(int(word)) for word in batch.frame_targets[0, :, 1, 1]]
    assert [q.strip() for q in quarters] == ["first", "first", "second", "third", "last", "last"]
    (row,) = [row for row, family in enumerate(batch.families) if family == "position"]
    assert int(batch.targets[row, 0]) in maker.letter_ids
    phase = LongRange(spread_share=1.0, frames=(6,), stream_frames=2400, span=400)
    spread = stream_batch(phase, maker, np.random.default_rng(3), 1)
    positions = spread.video_positions[0]
    assert bool((positions[1:] > positions[:-1]).all())  # in time order, never overlapping
    assert int(positions[-1]) < int(spread.frame_positions[0, 0]) + 400


def test_a_dense_batch_is_placed_as_full_attention_places_its_history_past_the_range():
    adapter = statekv.VideoQA.from_pretrained("builtin", method="full").adapter
    maker = BatchMaker(adapter)
    phase = LongRange(dense_share=1.0, dense_frames=(40,), dense_videos=1, stream_frames=2000)
    batch = dense_batch(phase, maker, np.random.default_rng(4))
    text = adapter.tokenizer.decode(batch.video_ids[0])
    seconds = [int(piece.split(":")[0]) for piece in text.split("Frame")[1:]]
    assert len(seconds) == 40 and seconds == list(range(seconds[0], seconds[0] + 40))  # consecutive seconds
    assert set(batch.families) == set(DENSE_FAMILIES) and len(batch.families) == len(DENSE_FAMILIES)
    assert bool((batch.frame_targets[:, :, 1, 1] == UNTRAINED).all())  # no quarter to learn from a window
    assert bool((batch.frame_targets[:, :, :, 0] >= 0).all() and (batch.frame_targets[:, :, 0, 1] >= 0).all())
    placed = batch.video_positions[0]
    cap = GroupedDistances().cap(4096)
    last = int(batch.frame_positions[-2, 1]) + 1  # the last frame's first token
    chunk = placed[last:]
    assert chunk.tolist() == list(range(int(chunk[0]), int(chunk[0]) + len(chunk)))  # the chunk at its own spacing
    assert bool((placed[1:] >= placed[:-1]).all()) and int(placed.max()) < 4096
    own = torch.arange(len(placed))
    prefix_end = adapter.prefix(adapter.start(40)).input_ids.shape[1]
    own[prefix_end:] += round((seconds[0] - 1) * (len(placed) - prefix_end) / 40)  # the frames before the window
    assert int(own[last]) > cap and int(chunk[0]) == cap  # past the range: the chunk at the layout's cap
    expected = grouped_places(own[last: last + 1], own[last: last + 1].clamp_max(cap), cap // 2, cap)(own)
    assert torch.equal(placed, expected)
    assert int(placed[last] - placed[0]) < int(own[last] - own[0]) // 2  # the far prefix's distance grouped


def test_a_whole_dense_batch_is_long_videos_from_their_first_frame_at_their_own_positions():
    adapter = statekv.VideoQA.from_pretrained("builtin", method="full").adapter
    maker = BatchMaker(adapter)
    phase = LongRange(dense_share=1.0, dense_frames=(20, 40), dense_videos=2, dense_whole=True)
    drawn, replayed = np.random.default_rng(6), np.random.default_rng(6)
    batch = dense_batch(phase, maker, drawn)
    frames = int(replayed.choice(phase.dense_frames))
    expected = maker.make(replayed, 4 if frames == 20 else 2, frames)  # two of the longest videos' frames
    assert batch.still_ids.shape == expected.still_ids.shape and batch.video_positions is None
    assert torch.equal(batch.video_ids, maker.video_ids(frames)) and torch.equal(batch.still_ids, expected.still_ids)
    assert torch.equal(batch.frame_targets, expected.frame_targets) and set(batch.families) == set(expected.families)
    assert drawn.bit_generator.state == replayed.bit_generator.state
    unquartered = dense_batch(LongRange(dense_share=1.0, dense_frames=(20, 40), dense_videos=2, dense_whole=True,
                                        dense_quarters=False), maker, np.random.default_rng(6))
    assert (unquartered.frame_targets[:, :, 1, 1] == UNTRAINED).all()  # a frame cannot tell its video's length
    quarters = batch.frame_targets[:, :, 1, 1] != UNTRAINED
    assert quarters.any() and torch.equal(unquartered.frame_targets[..., 0], batch.frame_targets[..., 0])


def test_the_lean_forward_reads_the_targets_the_eager_forward_reads():
    """The lean forward keeps one attention map of the video (the counting head's) instead of every layer's, and
    attends through SDPA: its outputs and gradients are the eager forward's up to rounding."""
    adapter = statekv.VideoQA.from_pretrained("builtin", method="full").adapter
    model = adapter.model
    model.train()
    model.set_attn_implementation("eager")
    maker, bank = BatchMaker(adapter), FrameBank(adapter)
    batch = dense_batch(LongRange(dense_share=1.0, dense_frames=(24,), dense_videos=2, stream_frames=2000), maker,
                        np.random.default_rng(4))

    def forward(lean: bool):
        model.zero_grad()
        outputs = forward_targets(model, bank, batch, lean=lean)
        sum(output.float().sum() for output in outputs).backward()
        grads = [parameter.grad.clone() for parameter in model.parameters() if parameter.grad is not None]
        return [output.detach() for output in outputs], grads

    (eager, eager_grads), (lean, lean_grads) = forward(False), forward(True)
    assert model.config.get_text_config()._attn_implementation == "eager"  # the questions' pass, and after
    for expected, got in zip(eager, lean, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert len(eager_grads) == len(lean_grads)
    for expected, got in zip(eager_grads, lean_grads, strict=True):  # each parameter's, to its own scale
        assert float((got - expected).abs().max()) <= 1e-4 * float(expected.abs().max()) + 1e-9
    decoder = model.model.language_model
    embeds = torch.randn(2, 50, decoder.config.hidden_size)
    with torch.no_grad():
        expected = decoder(inputs_embeds=embeds, output_attentions=True).attentions[0][:, 1]  # [B, L, L]
        with keeping_maps(decoder, {0: 1}) as maps:
            decoder(inputs_embeds=embeds)
    torch.testing.assert_close(maps[0], expected, rtol=0, atol=1e-6)  # the map itself: a mask off by one is not
    assert float(maps[0].triu(1).abs().sum()) == 0
    model.eval()


def test_a_training_run_can_send_every_video_through_the_lean_forward(tmp_path):
    recipe = Recipe(videos_per_batch=1, curriculum=((0, 1), (6, 2)), warmup_steps=1, log_every=1,
                    checkpoint_every=1, long_range=LongRange(steps=0))
    assert (train(recipe, tmp_path, lean_tokens=1) / "config.json").is_file()
    assert [json.loads(line)["step"] for line in (tmp_path / LOG_FILE).read_text().splitlines()] == [1, 2, 3]


def test_the_shipped_phase_draws_no_dense_batch_and_the_same_numbers():
    """``dense_share`` 0 (the shipped recipe's) takes nothing more from the generator: the phase's batches, and so
    the shipped weights, are what they were before dense batches existed."""
    adapter = statekv.VideoQA.from_pretrained("builtin", method="full").adapter
    maker = BatchMaker(adapter)
    phase = LongRange(video_share=0.0, frames=(6,), stream_frames=300, span=60)
    drawn, replayed = np.random.default_rng(5), np.random.default_rng(5)
    batch = draw_batch(phase, maker, drawn, 1)
    replayed.random()
    expected = stream_batch(phase, maker, replayed, 1)
    assert drawn.bit_generator.state == replayed.bit_generator.state
    assert torch.equal(batch.video_ids, expected.video_ids) and torch.equal(batch.still_ids, expected.still_ids)
    assert LongRange.from_dict({k: v for k, v in phase.to_dict().items() if not k.startswith("dense")}) == phase


def test_tokenizer_is_deterministic():
    first, second = build_tokenizer(), build_tokenizer()
    assert first.get_vocab() == second.get_vocab()
    assert len(first.tokenize("\nFrame96: ")) == 1 and len(first.tokenize("Frame1: ")) == 1


def test_frame_targets_count_each_object_and_place_each_frame():
    plan = plan_video(training_rng(TRAINING_SEEDS.start, 0), 12)
    words = frame_words(plan)  # per frame: (colour, shown so far) at its visual token, (shape, quarter) at </img>
    assert [(visual[0], end[0]) for visual, end in words] == [still_words(still) for still in plan.stills]
    for frames in plan.appearances:
        assert [words[frame][0][1] for frame in frames] == [f" {times}" for times in range(1, len(frames) + 1)]
    shown = {frame for frames in plan.appearances for frame in frames}
    assert all(words[frame][0][1] == " nothing" for frame in range(12) if frame not in shown)
    assert [end[1] for _, end in words] == [" first"] * 3 + [" second"] * 3 + [" third"] * 3 + [" last"] * 3


def test_weights_trained_here_load_from_their_folder_as_the_built_in_model_does(tmp_path):
    """A folder `statekv train-builtin` wrote (it holds the recipe) reads the built-in's prompt layout and takes its
    budget when none is given, so evaluating retrained weights by path asks what ``--model builtin`` asks; an
    evaluation run pins that layout, so a run begun when such a folder was read with the family's default refuses
    to resume (its identity named no layout)."""
    import shutil

    folder = shutil.copytree(WEIGHTS_DIR, tmp_path / "model")
    shipped = statekv.VideoQA.from_pretrained("builtin", method="statekv")
    trained = statekv.VideoQA.from_pretrained(str(folder), method="statekv")
    assert trained.adapter.layout == shipped.adapter.layout == "chat"
    assert trained.options.budget == shipped.options.budget == BUILTIN_BUDGET
    assert statekv.VideoQA.from_pretrained(folder, method="statekv", layout="paper").adapter.layout == "paper"
    assert EvalConfig.for_model("synthetic", folder, tmp_path, tmp_path / "run").identity()["layout"] == "chat"
    assert EvalConfig.for_model("synthetic", "builtin", tmp_path, tmp_path / "run").identity()["layout"] is None
    assert not is_builtin_kind("") and not is_builtin_kind("x" * 5000) and not is_builtin_kind(None)
    (folder / BUILTIN_RECIPE_FILE).unlink()  # any other checkpoint: the family's defaults
    other = statekv.VideoQA.from_pretrained(str(folder), method="statekv")
    assert other.adapter.layout == "paper" and other.options.budget != BUILTIN_BUDGET
    assert EvalConfig.for_model("synthetic", folder, tmp_path, tmp_path / "run").identity()["layout"] is None


def test_a_training_run_resumes_from_a_checkpoint_written_before_a_recipe_field_existed(tmp_path):
    """A field added to the recipe since (its default keeping the recipe what it was) does not make a saved run
    "another recipe"."""
    recipe = Recipe(videos_per_batch=1, curriculum=((0, 1), (3, 1)), warmup_steps=1, log_every=1,
                    checkpoint_every=1, long_range=LongRange(steps=0))  # the smallest run with a step to resume
    train(recipe, tmp_path, stop_after=1)
    state = torch.load(tmp_path / STATE_FILE, weights_only=True)
    for name in ("dense_share", "dense_frames", "dense_videos", "dense_whole", "dense_quarters"):
        del state["recipe"]["long_range"][name]
    torch.save(state, tmp_path / STATE_FILE)
    assert train(recipe, tmp_path).is_dir()
    state["recipe"]["long_range"]["dense_share"] = 0.5  # a recipe that differs is still refused
    torch.save(state, tmp_path / STATE_FILE)
    with pytest.raises(ConfigurationError, match="another recipe"):
        train(recipe, tmp_path)
