"""Architecture presets: the shapes that decide video-prefill FLOPs, for the seven models of the paper.

A preset holds only what the FLOPs depend on (widths, depths, head counts, tokens per step); weights,
vocabularies and RoPE variants cost no matrix multiply during prefill and are left out. Presets are built
from the public configs (see ``reference/models.md``) or from any checkpoint's config with
:func:`from_config`, and turned back into a transformers config with :func:`to_config` to instantiate a
weightless model on the meta device (see :mod:`statekv.flops.measured`).

One *step* is what the streaming engine feeds the language model at once: one frame for InternVL3 and
Eagle2.5, one temporal patch (two frames) for Qwen3-VL.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from statekv.errors import ConfigurationError
from statekv.settings.values import check_int

FAMILIES = ("internvl", "qwen3_vl", "eagle")

# Text tokens the LM sees per step besides the visual ones (prompt layout, see reference/models.md):
# InternVL3, the paper's layout: <img> ... </img> \n.  Qwen3-VL: "<t.t seconds>" (about 6 tokens) plus
# <|vision_start|> and <|vision_end|>.  Eagle2.5: "Frame i sample at t.tts: <img>" ... "</img>" (about 16).
DEFAULT_TEXT_TOKENS = {"internvl": 3, "qwen3_vl": 8, "eagle": 16}


@dataclass(frozen=True)
class LanguageSpec:
    """The decoder: SwiGLU MLP, grouped-query attention (``num_heads`` query heads share ``num_kv_heads``)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.num_heads % self.num_kv_heads:
            raise ConfigurationError(f"{self.num_heads} query heads cannot be grouped over "
                                     f"{self.num_kv_heads} KV heads")


@dataclass(frozen=True)
class VisionSpec:
    """The vision encoder (a plain ViT), its token merge and the projector into the LM.

    Attributes:
        num_layers, hidden_size, num_heads, intermediate_size: the ViT (GELU MLP, multi-head attention).
        patch_size, image_size: square patches of a square input frame.
        temporal_patch_size: frames fused by the patch embedding (Qwen3-VL: 2); one encoder call per step.
        class_token: the encoder prepends a CLS token (InternViT) that the projector drops.
        merge: ``merge x merge`` patches become one LM token (pixel shuffle / patch merger).
        projector: widths of the projector's chain of linear layers, input first, e.g. ``(4096, 896, 896)``.
        deepstack_mergers: extra mergers of the same shape fed from intermediate ViT layers (Qwen3-VL).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    image_size: int
    projector: tuple[int, ...]
    temporal_patch_size: int = 1
    class_token: bool = False
    merge: int = 2
    deepstack_mergers: int = 0

    def __post_init__(self) -> None:
        _check_positive(self, skip=("class_token", "deepstack_mergers", "projector"))
        if self.image_size % (self.patch_size * self.merge):
            raise ConfigurationError(f"image size {self.image_size} is not a multiple of patch {self.patch_size} "
                                     f"x merge {self.merge}")
        if len(self.projector) < 2 or min(self.projector) <= 0:
            raise ConfigurationError(f"projector widths must be two or more positive ints, got {self.projector}")

    @property
    def patches(self) -> int:
        """Patches per step (per frame, or per temporal patch of ``temporal_patch_size`` frames)."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def encoder_tokens(self) -> int:
        """Tokens the ViT attends over in one step (patches, plus the CLS token if any)."""
        return self.patches + int(self.class_token)

    @property
    def visual_tokens(self) -> int:
        """LM tokens produced per step after the merge."""
        return self.patches // self.merge**2


@dataclass(frozen=True)
class ModelSpec:
    """A video VLM as far as prefill FLOPs go.

    Attributes:
        name: preset key, e.g. ``"internvl3-8b"``.
        family: ``internvl``, ``qwen3_vl`` or ``eagle`` (decides how :func:`to_config` rebuilds it).
        language, vision: the two towers.
        text_tokens_per_step: prompt-layout tokens the LM sees per step besides the visual ones.
    """

    name: str
    family: str
    language: LanguageSpec
    vision: VisionSpec
    text_tokens_per_step: int

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigurationError(f"unknown model family {self.family!r}; expected one of {', '.join(FAMILIES)}")
        if self.text_tokens_per_step < 0:
            raise ConfigurationError(f"text_tokens_per_step must be >= 0, got {self.text_tokens_per_step}")
        if self.vision.projector[-1] != self.language.hidden_size:
            raise ConfigurationError(f"{self.name}: the projector ends at width {self.vision.projector[-1]}, "
                                     f"the LM's hidden size is {self.language.hidden_size}")

    @property
    def frames_per_step(self) -> int:
        return self.vision.temporal_patch_size

    @property
    def tokens_per_step(self) -> int:
        """LM tokens per step: 259 for InternVL3, 204 for Qwen3-VL at 448x448, 272 for Eagle2.5."""
        return self.vision.visual_tokens + self.text_tokens_per_step

    def with_layers(self, language: int | None = None, vision: int | None = None) -> ModelSpec:
        """A copy with fewer (or more) layers, for quick measurements; DeepStack mergers are kept."""
        lang = self.language if language is None else replace(self.language, num_layers=language)
        vis = self.vision if vision is None else replace(self.vision, num_layers=vision)
        return replace(self, language=lang, vision=vis)


def _check_positive(spec, skip: tuple[str, ...] = ()) -> None:
    for name, value in vars(spec).items():
        if name not in skip:
            check_int(value, f"{type(spec).__name__}.{name}")


# -- the seven models --------------------------------------------------------------------------------------

def _qwen2_lm(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int) -> LanguageSpec:
    return LanguageSpec(hidden, layers, heads, kv_heads, hidden // heads, ffn)


def _internvit(lm_hidden: int) -> VisionSpec:
    """InternViT-300M-448px-V2.5 + pixel shuffle 0.5 + LN -> Linear(4096 -> H) -> GELU -> Linear(H -> H)."""
    return VisionSpec(num_layers=24, hidden_size=1024, num_heads=16, intermediate_size=4096, patch_size=14,
                      image_size=448, class_token=True, projector=(4096, lm_hidden, lm_hidden))


def _qwen3_vit(lm_hidden: int, large: bool) -> VisionSpec:
    """Qwen3-VL ViT over one temporal patch, 2x2 merger (LN -> Linear -> GELU -> Linear) + 3 DeepStack."""
    layers, hidden, ffn = (27, 1152, 4304) if large else (24, 1024, 4096)
    return VisionSpec(num_layers=layers, hidden_size=hidden, num_heads=16, intermediate_size=ffn, patch_size=16,
                      image_size=448, temporal_patch_size=2, projector=(4 * hidden, 4 * hidden, lm_hidden),
                      deepstack_mergers=3)


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("internvl3-1b", "internvl", _qwen2_lm(896, 24, 14, 2, 4864), _internvit(896), 3),
        ModelSpec("internvl3-2b", "internvl", _qwen2_lm(1536, 28, 12, 2, 8960), _internvit(1536), 3),
        ModelSpec("internvl3-8b", "internvl", _qwen2_lm(3584, 28, 28, 4, 18944), _internvit(3584), 3),
        ModelSpec("qwen3-vl-2b", "qwen3_vl", LanguageSpec(2048, 28, 16, 8, 128, 6144), _qwen3_vit(2048, False), 8),
        ModelSpec("qwen3-vl-4b", "qwen3_vl", LanguageSpec(2560, 36, 32, 8, 128, 9728), _qwen3_vit(2560, False), 8),
        ModelSpec("qwen3-vl-8b", "qwen3_vl", LanguageSpec(4096, 36, 32, 8, 128, 12288), _qwen3_vit(4096, True), 8),
        ModelSpec(
            "eagle2.5-8b", "eagle", _qwen2_lm(3584, 28, 28, 4, 18944),
            # SigLIP so400m at 448 (no CLS) + pixel shuffle 0.5 + LN -> Linear(4608 -> 3584) -> GELU -> Linear.
            VisionSpec(num_layers=27, hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=14,
                       image_size=448, projector=(4608, 3584, 3584)),
            16,
        ),
    )
}


def get_preset(name: str) -> ModelSpec:
    """The preset called ``name`` (case-insensitive; ``InternVL3-8B`` and ``internvl3-8b`` both work)."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ConfigurationError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[key]


# -- transformers configs ----------------------------------------------------------------------------------

def from_config(config, *, name: str | None = None, text_tokens_per_step: int | None = None,
                image_size: int | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a transformers ``InternVLConfig`` or ``Qwen3VLConfig``.

    An InternVL config whose vision tower is SigLIP (``model_type == "siglip_vision_model"``) is read as
    Eagle2.5. ``image_size`` overrides the frame size (Qwen3-VL configs do not store one; default 448);
    ``text_tokens_per_step`` overrides the family's prompt-layout default.
    """
    model_type = getattr(config, "model_type", None)
    if model_type == "internvl":
        spec = _from_internvl(config, image_size)
    elif model_type == "qwen3_vl":
        spec = _from_qwen3_vl(config, image_size or 448)
    else:
        raise ConfigurationError(f"from_config supports internvl and qwen3_vl configs, got model_type {model_type!r}")
    return replace(spec, name=name or spec.name,
                   text_tokens_per_step=DEFAULT_TEXT_TOKENS[spec.family] if text_tokens_per_step is None
                   else text_tokens_per_step)


def _language_from(text) -> LanguageSpec:
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return LanguageSpec(text.hidden_size, text.num_hidden_layers, heads, text.num_key_value_heads or heads,
                        head_dim, text.intermediate_size)


def _side(value) -> int:
    """Square size from an int or an (h, w) pair."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ConfigurationError(f"only square frames/patches are supported, got {tuple(value)}")
        return int(value[0])
    return int(value)


def _from_internvl(config, image_size: int | None) -> ModelSpec:
    vision, language = config.vision_config, _language_from(config.text_config)
    merge = round(1 / config.downsample_ratio)
    siglip = vision.model_type == "siglip_vision_model"
    spec = VisionSpec(
        num_layers=vision.num_hidden_layers, hidden_size=vision.hidden_size, num_heads=vision.num_attention_heads,
        intermediate_size=vision.intermediate_size, patch_size=_side(vision.patch_size),
        image_size=image_size or _side(vision.image_size), class_token=not siglip, merge=merge,
        projector=(vision.hidden_size * merge**2, language.hidden_size, language.hidden_size),
    )
    family = "eagle" if siglip else "internvl"
    return ModelSpec(f"{family}-custom", family, language, spec, 0)


def _from_qwen3_vl(config, image_size: int) -> ModelSpec:
    vision, language = config.vision_config, _language_from(config.text_config)
    merge, hidden = vision.spatial_merge_size, vision.hidden_size
    spec = VisionSpec(
        num_layers=vision.depth, hidden_size=hidden, num_heads=vision.num_heads,
        intermediate_size=vision.intermediate_size, patch_size=vision.patch_size, image_size=image_size,
        temporal_patch_size=vision.temporal_patch_size, merge=merge,
        projector=(hidden * merge**2, hidden * merge**2, vision.out_hidden_size),
        deepstack_mergers=len(vision.deepstack_visual_indexes),
    )
    return ModelSpec("qwen3_vl-custom", "qwen3_vl", language, spec, 0)


def to_config(spec: ModelSpec):
    """A transformers config of the same shape (random-init semantics; RoPE left at its default).

    InternVL3 -> ``InternVLConfig``; Eagle2.5 -> ``InternVLConfig`` with a SigLIP vision tower (the HF InternVL
    model has exactly Eagle's pixel shuffle and projector); Qwen3-VL -> ``Qwen3VLConfig``.
    """
    lm, vis = spec.language, spec.vision
    if spec.family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        if vis.deepstack_mergers > vis.num_layers:
            raise ConfigurationError(f"{vis.deepstack_mergers} DeepStack mergers need as many ViT layers, "
                                     f"got {vis.num_layers}")
        # Where the mergers tap the ViT changes no FLOPs; spread them evenly ([5, 11, 17] for 24 layers).
        every = max(vis.num_layers // (vis.deepstack_mergers + 1), 1)
        return Qwen3VLConfig(
            vision_config=dict(
                depth=vis.num_layers, hidden_size=vis.hidden_size, num_heads=vis.num_heads,
                intermediate_size=vis.intermediate_size, patch_size=vis.patch_size,
                temporal_patch_size=vis.temporal_patch_size, spatial_merge_size=vis.merge,
                out_hidden_size=vis.projector[-1],
                deepstack_visual_indexes=[every * (i + 1) - 1 for i in range(vis.deepstack_mergers)],
            ),
            text_config=dict(
                hidden_size=lm.hidden_size, num_hidden_layers=lm.num_layers, num_attention_heads=lm.num_heads,
                num_key_value_heads=lm.num_kv_heads, head_dim=lm.head_dim, intermediate_size=lm.intermediate_size,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": _mrope(lm.head_dim),
                                 "mrope_interleaved": True},
            ),
        )
    from transformers import InternVLConfig, InternVLVisionConfig, Qwen2Config, SiglipVisionConfig

    if vis.projector[1:] != (lm.hidden_size, lm.hidden_size) or vis.temporal_patch_size != 1:
        raise ConfigurationError(f"{spec.name}: the HF InternVL model has a 2-layer projector to the LM width "
                                 "and one frame per step")
    shape = dict(hidden_size=vis.hidden_size, num_hidden_layers=vis.num_layers, num_attention_heads=vis.num_heads,
                 intermediate_size=vis.intermediate_size, patch_size=vis.patch_size, image_size=vis.image_size)
    if spec.family == "eagle":
        vision_config, strategy = SiglipVisionConfig(**shape, vision_use_head=False), "full"
    else:
        vision_config, strategy = InternVLVisionConfig(**shape), "default"
    text_config = Qwen2Config(hidden_size=lm.hidden_size, num_hidden_layers=lm.num_layers,
                              num_attention_heads=lm.num_heads, num_key_value_heads=lm.num_kv_heads,
                              head_dim=lm.head_dim, intermediate_size=lm.intermediate_size)
    return InternVLConfig(vision_config=vision_config, text_config=text_config, downsample_ratio=1 / vis.merge,
                          vision_feature_select_strategy=strategy, image_seq_length=vis.visual_tokens)


def _mrope(head_dim: int) -> list[int]:
    """M-RoPE sections (t, h, w) over head_dim / 2 frequencies, in Qwen3-VL's 24:20:20 proportion."""
    half = head_dim // 2
    h = w = half * 20 // 64
    return [half - h - w, h, w]
