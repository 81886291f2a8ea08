"""Training batches of synthetic videos, laid out exactly as the streaming adapter lays them out.

A batch holds ``B`` videos of ``N`` frames and one question of each family per video. The token ids come from
the `InternVLAdapter` itself (its prefix, ``frame_text`` and ``question_ids``), so the one-shot forward used
for training sees the very prompt that ``statekv`` streams at inference. Frames are never encoded to video
files here: every still a synthetic video can show is rendered and preprocessed once (`FrameBank`), and the
videos are written losslessly, so the model's input is the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
import torch
from transformers import DynamicCache

from ..models import InternVLAdapter
from ..models.base import LayoutState
from ..synthetic.plans import VideoPlan, plan_video
from ..synthetic.prompts import question_prompt
from ..synthetic.scenes import Still, all_stills, render, still_id
from ..synthetic.tasks import FAMILIES, QUARTERS, ask_all
from ..video import internvl_pixel_values
from .lean import keeping_maps


# The frame targets are read after this decoder layer (through the final norm and the output embedding), so
# each frame's count and time are known early enough for a later layer to look them up
FRAME_TARGET_LAYER = 1
# (layer, head) pairs whose attention from the word naming a question's subject is drawn to the evidence
# frames: one in the first layer, whose values are what the frames show, and one after `FRAME_TARGET_LAYER`,
# whose values also hold each frame's count and time; the last layer is left to carry the answer on
SUPERVISED_HEADS = ((0, 0), (FRAME_TARGET_LAYER + 1, 0))
# (layer, head) whose attention from each object frame's visual token is spread evenly over the visual tokens
# of that object's appearances so far and the first token of the prompt: the share left on that first token,
# 1 / (appearances + 1), is the running count the frame targets name
COUNTING_HEAD = (0, 1)
# (layer, head) whose attention from the position that says the answer letter is drawn to that subject word,
# after the second supervised head has brought the frames' counts and times there
READING_HEAD = (FRAME_TARGET_LAYER + 2, 0)


class FrameBank:
    """The preprocessed input of every still: float32 ``[S, 3, side, side]``, row ``still_id(still)``."""

    def __init__(self, adapter: InternVLAdapter):
        self.pixels = torch.stack([
            internvl_pixel_values(render(still), adapter.image_size, mean=adapter.image_mean, std=adapter.image_std)
            for still in all_stills()
        ])

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.pixels[ids]


@dataclass
class Reading:
    """What each question row reads instead of its whole video, as a question past the range reads its retrieved
    frames: the video tokens ``tokens`` ``[R, C]`` (the prompt's prefix, then a few frames' tokens in time order;
    padding repeats token 0), ``valid`` ``[R, C]`` bool (False: padding), the position each is read at ``places``
    ``[R, C]``, and where the question's prompt starts, ``start`` ``[R]``."""

    tokens: torch.Tensor
    valid: torch.Tensor
    places: torch.Tensor
    start: torch.Tensor


@dataclass
class Batch:
    """video_ids ``[1, Lv]`` (shared: every video of a batch has ``N`` frames); still_ids ``[B, N]``;
    question_ids ``[B * Q, Lq]`` right-padded, each row a question followed by its answer letter and the end
    token; targets ``[B * Q, 2]`` (answer letter, end token) predicted at ``target_positions`` ``[B * Q, 2]``
    of the question rows; families: the family of each row. frame_targets ``[B, N, 2, 2]``: two words each
    predicted at ``frame_positions`` ``[N, 2]`` of the video (after `FRAME_TARGET_LAYER`): at the frame's visual
    token, its colour and how many times its object has been shown so far; at its ``</img>``, its shape and
    which quarter of the video the frame lies in (`frame_words`). word_targets ``[B * Q]``: the first token of the right option's text, predicted at ``word_positions``
    ``[B * Q]``, each question's ``?``: the question alone decides the answer, before the options are read.
    evidence ``[B * Q, Lv]`` bool: the visual tokens and ``</img>`` of the frames that decide each question;
    the word just before its ``?`` (the one naming what it asks about) is trained to attend to them
    (`SUPERVISED_HEADS`), and the position that says the answer letter attends to that word (`READING_HEAD`).
    counting ``[B, Lv, Lv]``: the attention `COUNTING_HEAD` is trained towards, a row per object frame's visual
    token (all-zero rows elsewhere). All are auxiliary targets, at positions where nothing is ever decoded.
    video_positions ``[1, Lv]``: the RoPE position of each video token (None: its index), the questions continuing
    after the last. evidence_frames: each row's evidence frames. reading: what each row reads (None: its whole video,
    as the questions continue it).
    """

    video_ids: torch.Tensor
    still_ids: torch.Tensor
    question_ids: torch.Tensor
    target_positions: torch.Tensor
    targets: torch.Tensor
    families: list[str]
    frame_positions: torch.Tensor
    frame_targets: torch.Tensor
    word_positions: torch.Tensor
    word_targets: torch.Tensor
    evidence: torch.Tensor
    counting: torch.Tensor
    video_positions: torch.Tensor | None = None
    evidence_frames: list[tuple[int, ...]] = field(default_factory=list)
    reading: Reading | None = None

    @property
    def questions_per_video(self) -> int:
        return self.question_ids.shape[0] // self.still_ids.shape[0]


def still_words(still: Still) -> tuple[str, str]:
    """What a still shows, as its colour and shape words (" nothing" twice for an empty frame)."""
    if still.colour is None:
        return (" nothing", " nothing")
    return (f" {still.colour}", f" {still.shape}")


def frame_words(plan: VideoPlan) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """Per frame of ``plan``, the words for its visual token: its still's colour (`still_words`) and how many
    times its object has been shown so far (" nothing" for a frame without one); and for its ``</img>``: the
    still's shape and the first word of the frame's quarter (" first" ... " last"). Counted and placed frame
    by frame, these are what the count and position questions read back."""
    shown = [" nothing"] * plan.num_frames
    for frames in plan.appearances:
        for times, frame in enumerate(frames, start=1):
            shown[frame] = f" {times}"
    quarters = [" " + QUARTERS[plan.quarter(frame)].split()[0] for frame in range(plan.num_frames)]
    return [((colour, times), (shape, quarter)) for (colour, shape), times, quarter
            in zip(map(still_words, plan.stills), shown, quarters, strict=True)]


def counting_targets(plans: list[VideoPlan], visual: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, Lv, Lv]``: for the visual token of each appearance of an object, an even spread over the visual
    tokens of that object's appearances so far and the prompt's first token (see `COUNTING_HEAD`)."""
    targets = torch.zeros((len(plans), length, length))
    for video, plan in enumerate(plans):
        for frames in plan.appearances:
            for times, frame in enumerate(frames, start=1):
                row = targets[video, visual[frame]]
                row[visual[list(frames[:times])]] = 1 / (times + 1)
                row[0] = 1 / (times + 1)
    return targets


class BatchMaker:
    """Draws batches of synthetic videos and questions from seeded generators."""

    def __init__(self, adapter: InternVLAdapter, families: tuple[str, ...] = tuple(FAMILIES)):
        self.adapter = adapter
        self.families = families
        tokenizer = adapter.tokenizer
        self.letter_ids = tokenizer.convert_tokens_to_ids(list("ABCD"))
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = tokenizer.pad_token_id
        self._question_ids = lru_cache(maxsize=65536)(self._tokenize_question)
        self.question_mark_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("?")[0])
        words = [still_words(still) for still in all_stills()]
        self.still_words = torch.tensor([tokenizer.convert_tokens_to_ids(
            [tokenizer.tokenize(word)[0] for word in pair]) for pair in words])  # [S, 2]
        if any(len(tokenizer.tokenize(word)) != 1 for pair in words for word in pair):
            raise ValueError("the tokenizer splits a still's word; every colour and shape must be one token")

    @lru_cache(maxsize=64)
    def video_ids(self, num_frames: int) -> torch.Tensor:
        """The prompt up to the end of the video, ``[1, Lv]``: the layout's prefix, then each frame's text."""
        adapter = self.adapter
        state = adapter.start(num_frames)
        prefix = adapter.prefix(state)
        pieces = [] if prefix is None else [prefix.input_ids]
        pieces += [adapter.tokenize(adapter.frame_text(index, float(index))) for index in range(num_frames)]
        return torch.cat(pieces, dim=1).cpu()

    def timeline_ids(self, times: tuple[int, ...]) -> torch.Tensor:
        """``[1, Lv]``: the prefix, then frames taken at seconds ``times`` of a longer stream, each named by its
        second as the stream names it (``Frame{t+1}``), one after another (the first without the line break a
        frame before it would put there)."""
        adapter = self.adapter
        prefix = adapter.prefix(adapter.start(len(times)))
        pieces = [] if prefix is None else [prefix.input_ids]
        pieces += [adapter.tokenize(adapter.frame_text(time, float(time)).lstrip("\n") if index == 0
                                    else adapter.frame_text(time, float(time))) for index, time in enumerate(times)]
        return torch.cat(pieces, dim=1).cpu()

    def _tokenize_question(self, prompt: str) -> tuple[tuple[int, ...], int]:
        """The question's ids and the position of its question mark."""
        ids = tuple(self.adapter.question_ids(prompt, LayoutState())[0].tolist())
        return ids, ids.index(self.question_mark_id)

    @lru_cache(maxsize=64)
    def _word(self, text: str) -> int:
        """The id of the first token of ``text`` (with a space before it unless it has one)."""
        text = text if text.startswith(" ") else " " + text
        return self.adapter.tokenizer.convert_tokens_to_ids(self.adapter.tokenizer.tokenize(text)[0])

    def make(self, rng: np.random.Generator, videos: int, num_frames: int, times: tuple[int, ...] | None = None,
             length: int | None = None, asked: tuple[str, ...] | None = None) -> Batch:
        """``videos`` videos of ``num_frames`` frames, each asked every question family (``asked``: these
        only). ``times``, ``length``: the frames are seconds ``times`` (sorted) of a stream of ``length`` frames,
        named and placed in its quarters by those seconds (`timeline_ids`, `VideoPlan.quarter`)."""
        plans = [plan_video(rng, num_frames) for _ in range(videos)]
        if times is not None:
            plans = [replace(plan, times=tuple(times), length=length) for plan in plans]
        video_ids = self.video_ids(num_frames) if times is None else self.timeline_ids(tuple(times))
        rows, families, words, evidence, evidence_frames = [], [], [], [], []
        positions = self.frame_positions(num_frames) if times is None else frame_slots(video_ids, self.adapter)
        for plan in plans:
            for spec in ask_all(plan, rng, self.families if asked is None else asked):
                prompt, mark = self._question_ids(question_prompt(spec.question, spec.options))
                rows.append((*prompt, self.letter_ids[spec.answer], self.end_id))
                families.append(spec.family)
                words.append((mark, self._word(spec.options[spec.answer])))
                evidence.append(positions[list(spec.evidence)].flatten())
                evidence_frames.append(tuple(spec.evidence))
        width = max(map(len, rows))
        question_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        target_positions = torch.empty((len(rows), 2), dtype=torch.long)
        for row, ids in enumerate(rows):
            question_ids[row, : len(ids)] = torch.tensor(ids)
            target_positions[row] = torch.tensor([len(ids) - 3, len(ids) - 2])  # they predict the last two
        targets = question_ids.gather(1, target_positions + 1)
        still_ids = torch.tensor([[still_id(still) for still in plan.stills] for plan in plans])
        evidence_mask = torch.zeros((len(rows), video_ids.shape[1]), dtype=torch.bool)
        for row, frames in enumerate(evidence):
            evidence_mask[row, frames] = True
        frame_targets = torch.tensor([[[[self._word(word) for word in words] for words in frame]
                                       for frame in frame_words(plan)] for plan in plans])
        return Batch(video_ids, still_ids, question_ids, target_positions, targets, families, positions,
                     frame_targets, *torch.tensor(words).unbind(1), evidence_mask,
                     counting_targets(plans, positions[:, 0], video_ids.shape[1]), evidence_frames=evidence_frames)

    @lru_cache(maxsize=64)
    def frame_positions(self, num_frames: int) -> torch.Tensor:
        """``[N, 2]``: each frame's visual token and the ``</img>`` after it, in `video_ids`."""
        return frame_slots(self.video_ids(num_frames), self.adapter)


def frame_slots(video_ids: torch.Tensor, adapter: InternVLAdapter) -> torch.Tensor:
    """``[N, 2]``: each frame's visual token in ``video_ids`` ``[1, Lv]`` and the ``</img>`` after it."""
    slots = (video_ids[0] == adapter.image_token_id).nonzero().squeeze(-1)
    return torch.stack([slots, slots + 1], dim=-1)


def forward_targets(model, bank: FrameBank, batch: Batch, lean: bool = False) -> tuple[torch.Tensor, ...]:
    """From the model's ordinary batched forward (eager attention; the video's pass lean with ``lean``): the logits
    at the answer positions ``[B * Q, 2, vocab]``, at the frame positions ``[B, N, 2, vocab]`` and at the question
    marks ``[B * Q, vocab]``, and the attention masses ``[B * Q, len(SUPERVISED_HEADS) + 1]`` that the subject words
    give the evidence frames in `SUPERVISED_HEADS` and that the answer position gives the subject word in
    `READING_HEAD`; and the cross-entropy of `COUNTING_HEAD`'s attention against ``batch.counting`` (a scalar).

    The videos go through the decoder once (``[B, Lv]``, visual features in place of the image tokens); the
    key/value cache is repeated for each video's questions, which then run as one batch ``[B * Q, Lq]``. With
    causal attention this equals running every question after its own copy of the video; with ``batch.reading``,
    each question reads only what it names of its video's cache, placed where it says (`read_context`). lean: the
    video's pass keeps `COUNTING_HEAD`'s map alone (`statekv.builtin.lean`), not every layer's: for videos too long
    for them.
    """
    inner = model.model
    videos, frames = batch.still_ids.shape
    config = model.config
    features = inner.get_image_features(
        pixel_values=bank[batch.still_ids.reshape(-1)],
        vision_feature_layer=config.vision_feature_layer,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
    ).pooler_output  # [B * N, tokens per frame, D]
    video_ids = batch.video_ids.expand(videos, -1)
    embeds = inner.get_input_embeddings()(video_ids)
    slots = (video_ids == config.image_token_id).unsqueeze(-1).expand_as(embeds)
    embeds = embeds.masked_scatter(slots, features.reshape(-1, embeds.shape[-1]).to(embeds.dtype))
    placed = batch.video_positions
    layer, head = COUNTING_HEAD
    positions = {} if placed is None else {"position_ids": placed}
    if lean:
        with keeping_maps(inner.language_model, {layer: head}) as maps:
            video = inner.language_model(inputs_embeds=embeds, use_cache=True, output_hidden_states=True, **positions)
        attention = maps[layer]  # [B, Lv, Lv]
    else:
        video = inner.language_model(inputs_embeds=embeds, use_cache=True, output_hidden_states=True,
                                     output_attentions=True, **positions)
        attention = video.attentions[layer][:, head]  # [B, Lv, Lv]
    counted = batch.counting.sum(-1) > 0
    counting_loss = -(batch.counting * torch.log(attention + 1e-9)).sum(-1)[counted].mean()
    frames_hidden = inner.language_model.norm(video.hidden_states[FRAME_TARGET_LAYER + 1][:, batch.frame_positions])
    frame_logits = model.lm_head(frames_hidden)  # [B, N, 2, vocab]
    cache = video.past_key_values
    if batch.reading is None:
        cache.batch_repeat_interleave(batch.questions_per_video)
        after = {} if placed is None else {"position_ids": int(placed[0, -1]) + 1 + torch.arange(
            batch.question_ids.shape[1]).expand_as(batch.question_ids)}
        evidence, length = batch.evidence, batch.video_ids.shape[1]
    else:
        cache, after, evidence = read_context(inner.language_model, cache, batch)
        length = evidence.shape[1]
    questions = inner.language_model(input_ids=batch.question_ids, past_key_values=cache, use_cache=True,
                                     output_attentions=True, **after)
    hidden = questions.last_hidden_state
    picked = hidden.gather(1, batch.target_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    rows = torch.arange(hidden.shape[0])
    words = hidden[rows, batch.word_positions]
    evidence_mass = torch.stack([  # [B * Q, heads]
        (questions.attentions[layer][rows, head, batch.word_positions - 1, :length] * evidence).sum(-1)
        for layer, head in SUPERVISED_HEADS], dim=-1)
    layer, head = READING_HEAD
    reading_mass = questions.attentions[layer][rows, head, batch.target_positions[:, 0], length + batch.word_positions - 1]
    return (model.lm_head(picked), frame_logits, model.lm_head(words),
            torch.cat([evidence_mass, reading_mass[:, None]], -1), counting_loss)


def read_context(language_model, cache, batch: Batch) -> tuple[DynamicCache, dict[str, torch.Tensor], torch.Tensor]:
    """Each question row's own cache of what ``batch.reading`` says it reads of its video's ``cache`` (``[B, H, Lv,
    D]`` a layer, keys turned from where the video pass placed them to ``reading.places``, values as they are, the
    gradient kept), the question pass's ``position_ids`` and ``attention_mask`` (padding masked), and the evidence
    among what each row reads ``[R, C]`` bool."""
    reading = batch.reading
    rows = torch.arange(reading.tokens.shape[0]) // batch.questions_per_video  # each row's video
    own = torch.arange(batch.video_ids.shape[1]) if batch.video_positions is None else batch.video_positions[0]
    delta = reading.places - own[reading.tokens]  # [R, C]
    inv_freq = language_model.rotary_emb.inv_freq
    read = DynamicCache()
    for index, layer in enumerate(cache.layers):
        heads, width = layer.keys.shape[1], layer.keys.shape[-1]
        where = reading.tokens[:, None, :, None].expand(-1, heads, -1, width)
        keys = layer.keys.index_select(0, rows).gather(2, where)
        values = layer.values.index_select(0, rows).gather(2, where)
        read.update(turned(keys, delta[:, None], inv_freq), values, index)
    question_ids = batch.question_ids
    after = {"position_ids": reading.start[:, None] + torch.arange(question_ids.shape[1]),
             "attention_mask": torch.cat([reading.valid, torch.ones_like(question_ids, dtype=torch.bool)], 1).long()}
    return read, after, batch.evidence.gather(1, reading.tokens) & reading.valid


def turned(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``keys`` ``[..., N, D]`` (RoPE at some position, over all D dims) turned ``delta`` ``[..., N]`` positions
    more, as `statekv.core.positions.rotation.rotate` does, but differentiable."""
    angles = delta.unsqueeze(-1).float() * inv_freq.float()  # [..., N, D / 2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    first, second = keys.chunk(2, -1)
    return (keys.float() * cos + torch.cat([-second, first], -1).float() * sin).to(keys.dtype)


def still_logits(model, bank: FrameBank) -> torch.Tensor:
    """``[S, tokens per frame, vocab]``: every still's visual features read through the (tied) output
    embedding, before the decoder. Trained towards the still's colour and shape words, they make a frame's
    visual token look like the words that name it, which the decoder can then match against a question."""
    config = model.config
    features = model.model.get_image_features(
        pixel_values=bank.pixels, vision_feature_layer=config.vision_feature_layer,
        vision_feature_select_strategy=config.vision_feature_select_strategy).pooler_output
    return model.lm_head(features)
