"""Analytic video-prefill FLOPs, per step and as per-frame curves.

Counting convention (the one :class:`torch.utils.flop_counter.FlopCounterMode` uses, so that analytic and
measured numbers agree):

* a multiply-add is 2 FLOPs; only matrix products are counted (linear layers, convolutions, attention's
  ``QK^T`` and ``PV``). Norms, activations, softmax, RoPE and residual adds are O(tokens x width) and left
  out (well under 1% of a step);
* attention is counted over the full ``queries x keys`` tile: the causal mask inside a chunk is not halved,
  because dense kernels (eager, SDPA, FlashAttention tiles on the diagonal) compute the whole tile;
* GQA attention costs as many query heads as there are (``Hq``), whatever the KV head count;
* the LM head is not counted: prefill only needs hidden states (and the KV cache), never logits;
* embedding lookups, the one-time prompt prefix and the question are not part of *video* prefill.

A step sees ``history + T`` keys, ``T`` = tokens per step, with the history each registered method declares
(`statekv.settings.methods`): ``full`` carries everything (``history = s * T`` at step ``s``), ``recency`` the last
``R`` frames (``min(s, ceil(R / frames per step)) * T``), ``rekv`` its sinks and that window, ``statekv`` and
``keynorm`` at most ``B`` tokens (``min(s * T, B)``).

StateKV needs each key's attention mass. With ``score="eager"`` the probabilities the attention already
materialised are summed over queries: no extra matrix product (0 FLOPs under this convention). With
``score="recompute"`` (the Triton kernel, and the chunked backend past 16,384 keys) ``QK^T`` is computed a second
time: ``2 * Hq * T * K * d`` per layer. Either way StateKV scores only once its candidates exceed the budget
(``K > B``); before that it carries everything and attends like full attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from itertools import pairwise

import numpy as np

from statekv.errors import ConfigurationError
from statekv.settings.methods import MethodSettings, MethodSpec, method_names
from statekv.settings.methods import method as method_spec
from statekv.settings.values import check_int

from .presets import LanguageSpec, ModelSpec, VisionSpec, from_config, get_preset

COMPONENTS = ("vision", "projector", "lm_linear", "lm_attention", "score")
SCORE_PASSES = ("eager", "recompute")


@dataclass(frozen=True)
class Method:
    """A registered method (`statekv.settings.methods`) with its size: how much history each step attends to.

    Attributes:
        kind: the method's name (``full``, ``recency``, ``statekv``, ``rekv``, ``keynorm``...).
        budget: carried tokens per layer and KV head (``B``), for budget-sized methods.
        frames: the recency window ``R`` in frames, for window-sized methods; a family with several frames per
            step (Qwen3-VL: 2) carries ``ceil(R / frames_per_step)`` steps, as the engine and evaluation do.
        sinks: ReKV's attention-sink tokens (default: the registry's).
        window: SimpleStream's N, the last frames each question is answered from (encoded afresh with it).
    """

    kind: str
    budget: int | None = None
    frames: int | None = None
    sinks: int | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        spec = method_spec(self.kind)
        for size in fields(MethodSettings):
            value = getattr(self, size.name)
            if size.name == spec.size:  # required; checked as MethodSettings checks it
                MethodSettings.kind(size.name).check(value, f"{self.kind}'s {size.name}")
            elif value is not None and size.name not in spec.uses:
                raise ConfigurationError(f"{self.kind} takes no {size.name} (got {value!r})")
        _ = self.settings  # MethodSettings checks the sizes given

    @property
    def spec(self) -> MethodSpec:
        return method_spec(self.kind)

    @property
    def settings(self) -> MethodSettings:
        given = {size.name: getattr(self, size.name) for size in fields(MethodSettings)
                 if getattr(self, size.name) is not None}
        return MethodSettings(**given)

    @property
    def label(self) -> str:
        return self.spec.label(self.settings)

    @property
    def scores(self) -> bool:
        """Whether it scores tokens by attention mass (the score pass of the ``recompute`` convention)."""
        return self.spec.policy(self.settings, 1).needs_scores

    def history_tokens(self, step: np.ndarray | int, tokens_per_step: int, frames_per_step: int = 1) -> np.ndarray:
        """Earlier tokens visible to step ``step`` (0-based), elementwise over an array of steps."""
        return self.spec.history(self.settings, np.asarray(step, dtype=np.int64), tokens_per_step, frames_per_step)


def make_method(method: str | Method, budget: int | None = None, frames: int | None = None) -> Method:
    """``Method`` from a name plus its parameter; a ``Method`` passes through (with no extra parameters)."""
    if isinstance(method, Method):
        if budget is not None or frames is not None:
            raise ConfigurationError("pass budget/frames either inside the Method or as arguments, not both")
        return method
    if not isinstance(method, str):
        raise ConfigurationError(f"method must be one of {', '.join(method_names())}, got {method!r}")
    return Method(method.lower(), budget=budget, frames=frames)


def resolve_model(model) -> ModelSpec:
    """A ``ModelSpec`` from itself, a preset name, or a transformers InternVL / Qwen3-VL config."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return get_preset(model)
    if hasattr(model, "model_type"):
        return from_config(model)
    raise ConfigurationError(f"expected a ModelSpec, a preset name or a transformers config, "
                             f"got {type(model).__name__}")


# -- one step ----------------------------------------------------------------------------------------------

def vision_encoder_flops(vision: VisionSpec) -> int:
    """One step through the ViT: patch embedding, q/k/v/out projections, MLP and attention over its tokens."""
    n, width = vision.encoder_tokens, vision.hidden_size
    patch_embedding = 2 * vision.patches * (3 * vision.temporal_patch_size * vision.patch_size**2) * width
    linear = 2 * n * (4 * width * width + 2 * width * vision.intermediate_size)
    attention = 2 * 2 * n * n * width  # QK^T and PV, summed over heads (heads x head_dim = width)
    return patch_embedding + vision.num_layers * (linear + attention)


def projector_flops(vision: VisionSpec) -> int:
    """One step through the projector / merger and every DeepStack merger (same shape each)."""
    chain = sum(2 * a * b for a, b in pairwise(vision.projector))
    return (1 + vision.deepstack_mergers) * vision.visual_tokens * chain


def lm_linear_flops(language: LanguageSpec, tokens: int) -> int:
    """q/k/v/o projections and the SwiGLU MLP (gate, up, down) for ``tokens`` tokens over all layers."""
    d = language.hidden_size
    q_width = language.num_heads * language.head_dim
    kv_width = language.num_kv_heads * language.head_dim
    per_token = 2 * (2 * d * q_width + 2 * d * kv_width + 3 * d * language.intermediate_size)
    return language.num_layers * tokens * per_token


def lm_attention_flops(language: LanguageSpec, queries, keys):
    """``QK^T`` and ``PV`` for ``queries`` queries against ``keys`` keys, over all layers and query heads."""
    return language.num_layers * 2 * 2 * language.num_heads * language.head_dim * queries * keys


def step_flops(model, method: str | Method, step: int, *, budget: int | None = None, frames: int | None = None,
               score: str = "eager") -> dict[str, int]:
    """Exact FLOPs of step ``step`` (0-based) per component (see :data:`COMPONENTS`), as Python ints."""
    spec, method = resolve_model(model), make_method(method, budget, frames)
    _check_score(score)
    check_int(step, "step", minimum=0)
    tokens = spec.tokens_per_step
    keys = int(method.history_tokens(step, tokens, spec.frames_per_step)) + tokens
    attention = lm_attention_flops(spec.language, tokens, keys)
    return {
        "vision": vision_encoder_flops(spec.vision),
        "projector": projector_flops(spec.vision),
        "lm_linear": lm_linear_flops(spec.language, tokens),
        "lm_attention": attention,
        "score": attention // 2 if _scores(method, score, keys) else 0,
    }


def question_flops(model, context_tokens: int, question_tokens: int = 32, answer_tokens: int = 16) -> int:
    """Exact FLOPs of answering one question over ``context_tokens`` cached tokens: the question's tokens and
    each generated token through the LM's linears, and their attention over the context and what precedes them
    (the question's tile counted whole, as in prefill). Retrieval changes only ``context_tokens``."""
    language = resolve_model(model).language
    total = lm_linear_flops(language, question_tokens + answer_tokens)
    total += lm_attention_flops(language, question_tokens, context_tokens + question_tokens)
    for i in range(answer_tokens):
        total += lm_attention_flops(language, 1, context_tokens + question_tokens + i + 1)
    return total


def _scores(method: Method, score: str, keys):
    """Whether a step with ``keys`` keys pays a recomputed score pass (elementwise over an array of keys).

    StateKV scores only when its candidates (``keys``) exceed the budget; until then it carries everything.
    """
    if not method.scores or score != "recompute":
        return np.zeros_like(keys, dtype=bool) if isinstance(keys, np.ndarray) else False
    return keys > method.budget


def _check_score(score: str) -> None:
    if score not in SCORE_PASSES:
        raise ConfigurationError(f"unknown score pass {score!r}; expected one of {', '.join(SCORE_PASSES)}")


# -- curves over frames ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrefillFlops:
    """Video-prefill FLOPs of one model and method, frame by frame.

    Index ``i`` of every array is frame ``i + 1``. A step of several frames (Qwen3-VL) is split evenly over
    its frames, so cumulative values are exact at step boundaries.

    Attributes:
        model: the preset (or config-derived spec) the curves were computed for.
        method: the attention method.
        score: the score-pass convention (``eager`` or ``recompute``).
        breakdown: component name -> float64 ``[n_frames]`` marginal FLOPs of that component.
        marginal: float64 ``[n_frames]``: FLOPs to add frame ``i + 1`` (sum of the breakdown).
        cumulative: float64 ``[n_frames]``: FLOPs to prefill frames ``1..i+1`` (running sum of ``marginal``).
    """

    model: ModelSpec
    method: Method
    score: str
    breakdown: dict[str, np.ndarray] = field(repr=False)
    marginal: np.ndarray = field(repr=False)
    cumulative: np.ndarray = field(repr=False)

    @property
    def n_frames(self) -> int:
        return len(self.marginal)

    @property
    def frames(self) -> np.ndarray:
        """Frame numbers ``1..n_frames`` (x axis of the curves)."""
        return np.arange(1, self.n_frames + 1)

    @property
    def label(self) -> str:
        return f"{self.model.name} {self.method.label}"

    def at(self, frame: int) -> dict[str, float]:
        """Marginal breakdown, marginal and cumulative FLOPs at frame number ``frame`` (1-based)."""
        if not 1 <= frame <= self.n_frames:
            raise ConfigurationError(f"frame {frame} is outside 1..{self.n_frames}")
        i = frame - 1
        values = {name: float(curve[i]) for name, curve in self.breakdown.items()}
        return {**values, "marginal": float(self.marginal[i]), "cumulative": float(self.cumulative[i])}


def prefill_flops(model, method: str | Method, budget: int | None = None, frames: int | None = None,
                  n_frames: int = 512, *, score: str = "eager") -> PrefillFlops:
    """Marginal and cumulative video-prefill FLOPs of ``model`` under ``method`` for frames ``1..n_frames``.

    Args:
        model: a preset name (``"internvl3-8b"``), a :class:`ModelSpec`, or an InternVL / Qwen3-VL config.
        method: a registered method name (``"full"``, ``"recency"`` with ``frames`` = R frames, ``"statekv"``
            with ``budget`` = B, ...) or a :class:`Method`.
        n_frames: horizon in frames.
        score: StateKV's score pass, ``"eager"`` (free) or ``"recompute"`` (one more ``QK^T``).
    """
    spec, method = resolve_model(model), make_method(method, budget, frames)
    _check_score(score)
    check_int(n_frames, "n_frames")
    per_step = spec.frames_per_step
    steps = np.arange(math.ceil(n_frames / per_step), dtype=np.int64)
    tokens = spec.tokens_per_step
    keys = method.history_tokens(steps, tokens, spec.frames_per_step) + tokens
    attention = lm_attention_flops(spec.language, tokens, keys)  # int64 [n_steps]
    constant = {"vision": vision_encoder_flops(spec.vision), "projector": projector_flops(spec.vision),
                "lm_linear": lm_linear_flops(spec.language, tokens)}
    by_step = {name: np.full(len(steps), value, dtype=np.float64) for name, value in constant.items()}
    by_step["lm_attention"] = attention.astype(np.float64)
    by_step["score"] = np.where(_scores(method, score, keys), attention // 2, 0).astype(np.float64)
    breakdown = {name: np.repeat(by_step[name] / per_step, per_step)[:n_frames] for name in COMPONENTS}
    marginal = sum(breakdown.values())
    return PrefillFlops(spec, method, score, breakdown, marginal, np.cumsum(marginal))


def break_even(a: PrefillFlops | np.ndarray, b: PrefillFlops | np.ndarray, curve: str = "cumulative") -> int | None:
    """First frame number (1-based) at which ``a`` costs strictly less than ``b``; ``None`` if never.

    ``curve`` picks ``"cumulative"`` (total compute of a video that long) or ``"marginal"`` (cost of one more
    frame). Plain 1-D arrays are read as that curve already (index ``i`` = frame ``i + 1``). Only the common
    horizon of the two curves is searched.
    """
    if curve not in ("cumulative", "marginal"):
        raise ConfigurationError(f"curve must be 'cumulative' or 'marginal', got {curve!r}")
    xa, xb = (np.asarray(getattr(c, curve) if isinstance(c, PrefillFlops) else c, dtype=np.float64) for c in (a, b))
    if xa.ndim != 1 or xb.ndim != 1:
        raise ConfigurationError(f"break_even needs 1-D curves, got shapes {xa.shape} and {xb.shape}")
    horizon = min(len(xa), len(xb))
    cheaper = np.flatnonzero(xa[:horizon] < xb[:horizon])
    return int(cheaper[0]) + 1 if len(cheaper) else None
