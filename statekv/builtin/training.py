"""Training the built-in model on synthetic videos, on CPU, with full attention.

    from statekv.builtin.training import Recipe, train
    train(Recipe(), "runs/builtin")        # resumable: rerun the same call after an interruption

The recipe (`Recipe`): AdamW, linear warm-up then cosine decay, gradient clipping. The loss is the
cross-entropy of the answer letter and of the end-of-turn token after it, plus auxiliary targets, all at
positions where nothing is ever decoded, so the prompt layout is untouched (`statekv.builtin.batches.Batch`):

* still: every still's visual token, read through the (tied) output embedding, names the still's colour and
  shape, so a frame's visual token comes to look like the words a question names it by;
* frame: after the second decoder layer, each frame's visual token names its colour and how many times its object has
  been shown so far, and its ``</img>`` its shape and the quarter of the video it lies in;
* word: at each question's ``?``, the first word of the right option (the question alone decides it);
* evidence: the word naming what a question asks about (the one before its ``?``) attends, in two supervised
  heads (layers 0 and 2), to the frames that decide the answer, and the position that says the letter
  attends to that word (layer 3);
* counting: while the video is encoded, a head of layer 0 spreads the attention of each object frame evenly
  over that object's appearances so far and the prompt's first token, so the share left on that token says
  how many times the object has been shown.

They split an answer into steps a small model learns one at a time (see a frame, keep count and time, find
the frames a question names, read them, say the letter). Without the evidence target the model does not learn
to find frames by colour within this budget (attribute, count and position stay at chance), and without the
last-layer head trained to read the subject word, position stays at chance (docs/accuracy.md).

The curriculum starts with vision steps (frames 0: the still targets alone, a few milliseconds each), then
trains on videos that grow from 3 frames (two objects, where attention finds the evidence at once) to the
benchmark's 96; trained on long videos from the start the model stays at chance. Each step draws
``videos_per_batch`` fresh videos from the training seed range and asks every question family about each.
A last phase (`statekv.builtin.long_range.LongRange`, with a fresh optimiser) trains it for streams past its
range: frames far apart in long streams, named by their second, packed or spread as a question reads them.

The run directory holds ``log.jsonl`` (one line per ``log_every`` steps, and one for the steps since the last at a
stop or ``stop_after``: loss, answer accuracy per family, learning rate, time), ``checkpoint.pt`` (model,
optimiser and step; written atomically every ``checkpoint_every`` steps, and when a stop (Ctrl-C, SIGTERM,
SIGHUP) ends the run, each forced to the device with the log lines of its steps, so a power loss keeps them; the
one before it is kept as ``checkpoint.previous.pt``, so a damaged latest checkpoint resumes from the one before)
and, at the end, ``model/``: the checkpoint folder (``save_pretrained``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from ..errors import ConfigurationError, DataError, OutputError
from ..locks import FileLock
from ..console import one_line
from ..flushing import flush_file, flush_folder, write_whole
from ..models import InternVLAdapter
from ..settings.values import is_finite_number
from ..stopping import note_kept, stop_point, whole
from ..synthetic.seeds import TRAINING_SEEDS, training_rng
from ..video import IMAGENET_MEAN, IMAGENET_STD
from .architecture import IMAGE_SIZE, LAYOUT, build_model, build_tokenizer, count_parameters
from .checkpoint import save_checkpoint
from .batches import BatchMaker, FrameBank, forward_targets, still_logits
from .long_range import LongRange, draw_batch

logger = logging.getLogger(__name__)

LOG_FILE = "log.jsonl"
STATE_FILE = "checkpoint.pt"
PREVIOUS_STATE_FILE = "checkpoint.previous.pt"
UNFINISHED_STATE_FILE = STATE_FILE + ".tmp"  # written whole, then renamed over STATE_FILE
STATE_KEYS = ("recipe", "step", "seconds", "model", "optimizer")
MODEL_DIR = "model"


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained weights (with the code): see the module docstring.

    curriculum: ``(frames, steps)`` stages, run in order. seed: the training seed (in `TRAINING_SEEDS`); it
    also seeds the initialisation. long_range: the phase after the curriculum (its steps 0: none).
    """

    seed: int = TRAINING_SEEDS.start
    videos_per_batch: int = 16
    curriculum: tuple[tuple[int, int], ...] = ((0, 300), (3, 300), (6, 200), (9, 300), (12, 500), (24, 500), (48, 500),
                                               (96, 1000))
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    final_learning_rate: float = 1e-4
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    end_token_weight: float = 0.1
    frame_loss_weight: float = 0.2
    still_loss_weight: float = 1.0
    word_loss_weight: float = 0.5
    evidence_loss_weight: float = 0.2
    log_every: int = 25
    checkpoint_every: int = 100
    long_range: LongRange = LongRange()

    @property
    def curriculum_steps(self) -> int:
        return sum(steps for _, steps in self.curriculum)

    @property
    def steps(self) -> int:
        return self.curriculum_steps + self.long_range.steps

    def frames_at(self, step: int) -> int | None:
        """The video length of step ``step`` (0-based); None in the long-range phase (it draws one per step)."""
        for frames, steps in self.curriculum:
            if step < steps:
                return frames
            step -= steps
        if step < self.long_range.steps:
            return None
        raise ValueError(f"step {step} is past the recipe")

    def learning_rate_at(self, step: int) -> float:
        if step >= self.curriculum_steps:
            return self.long_range.learning_rate_at(step - self.curriculum_steps)
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.curriculum_steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.final_learning_rate + (self.learning_rate - self.final_learning_rate) * cosine

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "curriculum": [list(stage) for stage in self.curriculum],
                "long_range": self.long_range.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Recipe":
        data = dict(data)
        data["curriculum"] = tuple(tuple(stage) for stage in data["curriculum"])
        data["long_range"] = LongRange.from_dict(data["long_range"]) if "long_range" in data else LongRange(steps=0)
        return cls(**data)


def train(recipe: Recipe, out: str | Path, *, threads: int = 2, stop_after: int | None = None,
          init: str | Path | None = None, lean_tokens: int | None = None) -> Path:
    """Train (or resume) ``recipe`` in ``out``; returns the exported checkpoint folder ``out/model``.

    stop_after: stop once this many steps are done in all (to split a run; rerun to go on). init: a checkpoint
    folder holding the weights the curriculum ends with (the built-in model before its long-range phase): a run
    that has not started starts from them at the long-range phase. lean_tokens: videos longer than this many
    tokens go through the lean forward, which keeps one attention map of the video instead of every layer's
    (`statekv.builtin.lean`: the same losses up to rounding; None: every video through the eager forward).
    """
    if recipe.seed not in TRAINING_SEEDS or recipe.long_range.seed not in TRAINING_SEEDS:
        raise ConfigurationError(f"the training seeds must be in [{TRAINING_SEEDS.start}, {TRAINING_SEEDS.stop})")
    callers_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # tiny gradients and Adam moments would otherwise take the slow path
    try:
        return _train(recipe, Path(out), stop_after, init, lean_tokens, threads)
    finally:  # the caller's arithmetic back (flushed, a subnormal such as max_fps=1e-310 reads as 0), and its
        # threads (left at two, a one-thread caller's work contends with itself and spins on a shared CPU)
        torch.set_flush_denormal(False)
        torch.set_num_threads(callers_threads)


def _train(recipe: Recipe, out: Path, stop_after: int | None, init: str | Path | None,
           lean_tokens: int | None, threads: int) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lock = FileLock.acquire(out, what=f"the training run's folder {out}", error=OutputError,
                            advice="another train-builtin is writing it: wait for it to end, or give this one "
                                   "another --out")
    try:
        return _train_locked(recipe, out, stop_after, init, lean_tokens, threads)
    finally:
        lock.release()


def _train_locked(recipe: Recipe, out: Path, stop_after: int | None, init: str | Path | None,
                  lean_tokens: int | None, threads: int) -> Path:
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=recipe.seed)
    adapter = InternVLAdapter(model, tokenizer, layout=LAYOUT, image_size=IMAGE_SIZE, image_mean=IMAGENET_MEAN,
                              image_std=IMAGENET_STD)
    model.train()  # the adapter put it in eval mode
    model.set_attn_implementation("eager")  # training reads attention probabilities (the evidence loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=recipe.weight_decay)
    step, elapsed = _resume(out, recipe, model, optimizer)
    ran_on = run_field(out, "threads") if step else None
    if step:
        began = run_field(out, "init")  # as the run was begun: a resume without --init goes on from it
    else:
        began = None if init is None else str(Path(init).resolve())
    if ran_on is not None and ran_on != threads:
        logger.warning("the run's steps so far ran on %d threads: going on with %d, its weights differ in their "
                       "last bits from those of a run on one thread count throughout", ran_on, threads)
    if step == 0 and init is not None:
        try:
            model.load_state_dict(_weights(init))
        except RuntimeError as error:  # torch names every tensor that does not fit: the first says enough
            raise DataError(f"{init}: not the built-in model's architecture, so its weights cannot start the "
                            f"long-range phase ({one_line_reason(error)})") from None
        step = recipe.curriculum_steps
    marks = {"threads": threads, "init": began}
    logger.info("%d parameters; training %d steps from step %d", count_parameters(model.parameters()),
                recipe.steps, step)
    bank, maker = FrameBank(adapter), BatchMaker(adapter)
    window = _Window()
    last = min(recipe.steps, stop_after) if stop_after is not None else recipe.steps
    started = time.monotonic() - elapsed
    saved = step
    try:
        while step < last:
            if step == recipe.curriculum_steps:
                optimizer.state.clear()  # the long-range phase starts with a fresh optimiser
            for group in optimizer.param_groups:
                group["lr"] = recipe.learning_rate_at(step)
            loss, parts, answers = _step_loss(recipe, model, bank, maker, step, lean_tokens)
            stop_point()  # the batch is drawn with numpy, which can swallow a Ctrl-C
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_norm)
            with whole():  # a stop lands before the update or after its count: a checkpoint names the step it holds
                optimizer.step()
                step += 1
                window.add(parts, answers)  # with the count: a stop's log line below holds every step it counts
            if step % recipe.log_every == 0 or step == last:
                _log(out, window.flush(step, recipe, time.monotonic() - started))
            if step % recipe.checkpoint_every == 0 or step == last:
                _save_state(out, recipe, model, optimizer, step, time.monotonic() - started, marks)
                saved = step
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM, SIGHUP: keep every step finished (one cut short is redone)
        if step > saved:
            if window.parts:  # the steps since the last log line, logged as --stop-after logs its last step
                _log(out, window.flush(step, recipe, time.monotonic() - started))
            _save_state(out, recipe, model, optimizer, step, time.monotonic() - started, marks)
        logger.info("stopped after step %d of %d; checkpoint saved to %s (rerun to go on)", step, recipe.steps,
                    out / STATE_FILE)
        note_kept(stop, f"{out / STATE_FILE} holds step {step} of {recipe.steps}: rerun the same command to go on"
                  if (out / STATE_FILE).is_file() else "no step was finished")  # (from --init: none yet)
        raise
    if step >= recipe.steps:
        try:
            save_checkpoint(model.eval(), tokenizer, out / MODEL_DIR, recipe=recipe.to_dict())
        except OutputError as error:
            raise OutputError(f"{error}; {out / STATE_FILE} keeps all {step} steps: rerun to write it") from None
    return out / MODEL_DIR


def _step_loss(recipe: Recipe, model, bank: FrameBank, maker: BatchMaker, step: int, lean_tokens: int | None):
    """Step ``step``'s loss, its named parts (floats) and, unless it is a vision step, the answers
    ``(correct [B * Q] bool, families)``."""
    words = still_logits(model, bank).flatten(0, 1).float()  # [S, vocab]: one visual token per still
    still_loss = F.cross_entropy(words, maker.still_words[:, 0]) + F.cross_entropy(words, maker.still_words[:, 1])
    frames = recipe.frames_at(step)
    if frames == 0:  # a vision step: the stills alone
        return still_loss, {"still_loss": still_loss.item()}, None
    if frames is None:
        phase_step = step - recipe.curriculum_steps
        batch = draw_batch(recipe.long_range, maker, training_rng(recipe.long_range.seed, phase_step),
                           recipe.videos_per_batch)
    else:
        batch = maker.make(training_rng(recipe.seed, step), recipe.videos_per_batch, frames)
    lean = lean_tokens is not None and batch.video_ids.shape[1] > lean_tokens
    logits, frame_logits, word_logits, evidence_mass, counting_loss = forward_targets(model, bank, batch, lean=lean)
    losses = {"loss": F.cross_entropy(logits[:, 0].float(), batch.targets[:, 0]),
              "end_loss": F.cross_entropy(logits[:, 1].float(), batch.targets[:, 1]),
              "frame_loss": F.cross_entropy(frame_logits.unsqueeze(3).expand(*batch.frame_targets.shape, -1)
                                            .flatten(0, 3).float(), batch.frame_targets.flatten()),
              "word_loss": F.cross_entropy(word_logits.float(), batch.word_targets),
              "evidence_loss": -torch.log(evidence_mass.float() + 1e-6).mean(),
              "counting_loss": counting_loss,
              "still_loss": still_loss}
    loss = (losses["loss"] + recipe.end_token_weight * losses["end_loss"]
            + recipe.frame_loss_weight * losses["frame_loss"] + recipe.word_loss_weight * losses["word_loss"]
            + recipe.evidence_loss_weight * (losses["evidence_loss"] + losses["counting_loss"])
            + recipe.still_loss_weight * still_loss)
    correct = logits[:, 0].argmax(-1) == batch.targets[:, 0]
    return loss, {name: value.item() for name, value in losses.items()}, (correct, batch.families)


class _Window:
    """Losses and answer accuracy per family over the steps since the last log line."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = defaultdict(list)
        self.right: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.cpu = time.process_time()

    def add(self, parts: dict[str, float], answers: tuple[torch.Tensor, list[str]] | None) -> None:
        for name, value in parts.items():
            self.parts[name].append(value)
        if answers is not None:
            correct, families = answers
            for family, ok in zip(families, correct.tolist(), strict=True):
                self.right[family][0] += int(ok)
                self.right[family][1] += 1

    def flush(self, step: int, recipe: Recipe, seconds: float) -> dict[str, Any]:
        answered = sum(total for _, total in self.right.values())
        frames = recipe.frames_at(step - 1)
        line = {"step": step, "frames": "long-range" if frames is None else frames,
                **{name: sum(values) / len(values) for name, values in self.parts.items()},
                "accuracy": sum(right for right, _ in self.right.values()) / answered if answered else None,
                "family_accuracy": {family: right / total for family, (right, total) in sorted(self.right.items())},
                "learning_rate": recipe.learning_rate_at(step - 1), "seconds": round(seconds, 1),
                "cpu_seconds_since_last": round(time.process_time() - self.cpu, 1)}
        self.__init__()
        return line


def _log(out: Path, line: dict[str, Any]) -> None:
    if line["accuracy"] is None:
        logger.info("step %d (stills): still loss %.3f", line["step"], line["still_loss"])
    else:
        logger.info("step %d (%s frames): loss %.3f, accuracy %.3f", line["step"], line["frames"], line["loss"],
                    line["accuracy"])
    try:
        with (out / LOG_FILE).open("a", encoding="utf-8") as file:
            file.write(json.dumps(line) + "\n")
    except OSError as error:  # a full disk: the checkpoint keeps the steps; a resume rewrites the log from it
        raise OutputError(f"cannot write the training log {out / LOG_FILE} ({one_line_reason(error)}); the run "
                          f"goes on from its last checkpoint, {trained_steps(out)} steps") from None


def _weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The weights of the checkpoint folder ``folder``, loaded as the built-in model is (`from_pretrained`)."""
    from transformers import InternVLForConditionalGeneration

    if not (Path(folder) / "config.json").is_file():
        raise DataError(f"{folder}: not a checkpoint folder (no config.json) to start the long-range phase from")
    try:
        return InternVLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).state_dict()
    except (OSError, ValueError) as error:  # no weights beside its config, or weights of another model
        raise DataError(f"{folder}: cannot load its weights to start the long-range phase from "
                        f"({one_line_reason(error)})") from None


def _save_state(out: Path, recipe: Recipe, model, optimizer, step: int, seconds: float,
                marks: dict[str, Any]) -> None:
    """Write ``checkpoint.pt`` atomically, keeping the one it replaces as ``checkpoint.previous.pt``. Written whole
    first (`UNFINISHED_STATE_FILE`): a stop between the two renames leaves it, and the resume takes it. The log
    lines of its steps are forced to the device before it, so a power loss cannot keep a checkpoint past them.
    ``marks``: how the run was made that its recipe does not say (``threads``, ``init``: `run_field`)."""
    temporary, log = out / UNFINISHED_STATE_FILE, None
    try:
        torch.save({"recipe": recipe.to_dict(), "step": step, "seconds": seconds, "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(), **marks}, temporary)
        flush_file(temporary)
        if (out / LOG_FILE).is_file():
            log = out / LOG_FILE
            flush_file(log)
    except (OSError, RuntimeError) as error:
        temporary.unlink(missing_ok=True)
        if log is not None:  # never flushed again: a later flush would vouch for lines this one may have lost
            raise OutputError(f"cannot force the training log {log} to the device ({write_failure(error)}), so no "
                              f"checkpoint is written past its lines and the run stops: rerun to go on from the last "
                              f"one written, {trained_steps(out)} steps (the log cut back to it)") from None
        raise OutputError(f"cannot write the training checkpoint {out / STATE_FILE} ({write_failure(error)}); "
                          f"the run goes on from the last one written, {trained_steps(out)} steps") from None
    _commit_state(out)


def _commit_state(out: Path) -> None:
    """Make the checkpoint written whole (`UNFINISHED_STATE_FILE`) the run's, the one it replaces the previous; the
    renames forced to the device (a power loss then cannot take the checkpoint back)."""
    if (out / STATE_FILE).is_file():
        os.replace(out / STATE_FILE, out / PREVIOUS_STATE_FILE)
    os.replace(out / UNFINISHED_STATE_FILE, out / STATE_FILE)
    flush_folder(out)


def write_failure(error: BaseException) -> str:
    """Why a file could not be written, in words: torch's writer says a full disk as a position it did not reach."""
    if isinstance(error, RuntimeError) and "unexpected pos" in str(error):
        return "it could not be written whole: the disk is full or a file size limit was reached"
    return one_line_reason(error)


def trained_steps(out: str | Path) -> int:
    """The steps a run in ``out`` has done, as its last readable checkpoint records them (0 before its first): one
    written whole that a stop kept from being renamed is the newest."""
    return int(run_field(out, "step") or 0)


def run_field(out: str | Path, name: str) -> Any:
    """Field ``name`` of the last readable checkpoint of the run in ``out`` (``step``; ``threads`` and ``init``,
    None in a checkpoint written before they were kept; None before its first)."""
    for path in (Path(out) / UNFINISHED_STATE_FILE, Path(out) / STATE_FILE, Path(out) / PREVIOUS_STATE_FILE):
        try:
            return torch.load(path, weights_only=True, map_location="cpu").get(name)
        except Exception:  # noqa: BLE001 -- missing or damaged: the one before it, if any
            continue
    return None


def _resume(out: Path, recipe: Recipe, model, optimizer) -> tuple[int, float]:
    """Load the last good checkpoint (``checkpoint.pt``, else ``checkpoint.previous.pt``) if there is one;
    returns (steps done, seconds spent). A damaged checkpoint is skipped with a warning naming it; when none
    is usable, a one-line `DataError` says so."""
    _finish_commit(out, recipe, model, optimizer)
    paths = [path for path in (out / STATE_FILE, out / PREVIOUS_STATE_FILE) if path.is_file()]
    if not paths:
        (out / LOG_FILE).unlink(missing_ok=True)
        return 0, 0.0
    problems = []
    for path in paths:
        try:
            state = _read_state(path, recipe, model, optimizer)
        except DataError as error:
            logger.warning("%s", error)
            problems.append(str(error))
            continue
        _truncate_log(out / LOG_FILE, state["step"])
        if path != paths[0]:  # the damaged one set aside: the next save would make it the only one kept
            paths[0].replace(paths[0].with_name(paths[0].name + ".damaged"))
        return int(state["step"]), float(state["seconds"])
    raise DataError(f"{problems[0]}; no usable checkpoint in {out}: delete {STATE_FILE} (and "
                    f"{PREVIOUS_STATE_FILE}) to start over")


def _finish_commit(out: Path, recipe: Recipe, model, optimizer) -> None:
    """A checkpoint a stop left written whole but not yet renamed (it is the newest) becomes the run's; one a stop
    cut short is removed (the checkpoints before it stand)."""
    if not (out / UNFINISHED_STATE_FILE).is_file():
        return
    try:
        _read_state(out / UNFINISHED_STATE_FILE, recipe, model, optimizer)
    except DataError:
        logger.info("%s: removing a checkpoint a stop cut short", out / UNFINISHED_STATE_FILE)
        (out / UNFINISHED_STATE_FILE).unlink()
        return
    _commit_state(out)


def _read_state(path: Path, recipe: Recipe, model, optimizer) -> dict[str, Any]:
    """A checkpoint's contents, installed in ``model`` and ``optimizer`` only once all of it is readable."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as error:  # truncated, not a zip, pickled objects: torch raises many kinds
        raise DataError(f"{path}: damaged training checkpoint ({one_line_reason(error)})") from None
    if not isinstance(state, dict) or any(key not in state for key in STATE_KEYS):
        missing = next((key for key in STATE_KEYS if not isinstance(state, dict) or key not in state), "?")
        raise DataError(f"{path}: damaged training checkpoint (no field {missing!r})")
    try:
        saved = Recipe.from_dict(state["recipe"])
    except (TypeError, KeyError, ValueError, AttributeError) as error:
        raise DataError(f"{path}: damaged training checkpoint (its recipe: {one_line_reason(error)})") from None
    if saved != recipe:  # compared as recipes: a field added since reads as its default
        raise ConfigurationError(f"{path.parent} holds a run of another recipe; use another output folder")
    step, seconds = state["step"], state["seconds"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 < step <= recipe.steps:
        raise DataError(f"{path}: damaged training checkpoint (field 'step' is {step!r}, not 1 to {recipe.steps})")
    if not is_finite_number(seconds) or seconds < 0:
        raise DataError(f"{path}: damaged training checkpoint (field 'seconds' is {seconds!r})")
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    try:
        for name, tensor in state["model"].items():
            if not torch.isfinite(tensor).all():
                raise DataError(f"{path}: damaged training checkpoint (weight {name} holds NaN or inf)")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except DataError:
        model.load_state_dict(weights)
        raise
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as error:
        model.load_state_dict(weights)
        raise DataError(f"{path}: damaged training checkpoint ({one_line_reason(error)})") from None
    return state


def one_line_reason(error: BaseException) -> str:
    return one_line(error)[:200]


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint (their steps are trained again), and damaged lines (each
    named in a warning)."""
    if not path.is_file():
        return
    kept = []
    for number, line in enumerate(path.read_bytes().decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        entry = log_entry(line)
        if entry is None:
            logger.warning("%s:%d: dropping a damaged log line", path, number)
        elif entry["step"] <= step:
            kept.append(line)
    try:
        write_whole(path, "".join(line + "\n" for line in kept).encode())
    except OSError as error:
        raise OutputError(f"cannot rewrite the training log {path} to the checkpoint's step {step} "
                          f"({write_failure(error)}); it is kept as it was") from None


def log_entry(line: str) -> dict[str, Any] | None:
    """A log line's entry, or None when it is not a JSON object with an integer step."""
    try:
        entry = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None
    step = entry.get("step") if isinstance(entry, dict) else None
    return entry if isinstance(step, int) and not isinstance(step, bool) else None
