"""What a model family is, in one place: a spec that states the family's facts and names its parts.

A vision family (``TowerSpec``) is one tower kind (``VisionConfig.kind``) with everything neva's layers need to know
of it: its defaults and checks, the class that computes it, the front end that turns a record's images into its inputs,
its patch merger, its HF and LLaVA interop, and the facts its FLOP and memory terms read. Generic code asks the spec
(``neva.families.tower_spec``) and never a family's name; a new family is one spec file and one registry line
(docs/ARCHITECTURE.md, "Adding a family").

The spec sits below every package that uses it, so its code parts (the tower class, the front end, the interop) are
named by dotted path (``"neva.models.vision:VisionTower"``) and resolved by the package that owns them (``part``):
the tower by ``neva.models``, the front end and the conversation template by ``neva.data``, the interop by
``neva.checkpoint``. No import points up;
``tests/test_dependencies.py`` checks that each part lives in the package that resolves it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Which package resolves each code part of a spec (and so where the part must live).
PART_OWNERS = {
    "tower": "neva.models",
    "front_end": "neva.data",
    "fit": "neva.data",
    "tiles": "neva.data",
    "interop": "neva.checkpoint",
    "projector": "neva.models",
    "native_sizes": "neva.data",
    "projector_plan": "neva.parallel",
    "template": "neva.data.templates",
}


def part(path: str) -> Any:
    """The object a spec names by ``"package.module:attribute"``."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class MergerSpec:
    """A native tower's patch merger, as a projector type (``ProjectorConfig.type``): the norm over each patch before
    the merge (``layer``: LayerNorm, ``rms``: RMSNorm; eps 1e-6 as HF) and whether DeepStack mergers (LayerNorm after
    the merge) sit beside it, one per ``VisionConfig.deepstack_visual_indexes``."""

    projector: str
    norm: str
    deepstack: bool = False
    # Its norm's epsilon is the decoder's ``rms_norm_eps`` (Mistral 3's projector), set as ``ProjectorConfig.norm_eps``.
    decoder_eps: bool = False
    # Its SwiGLU is bias-free and as wide as the decoder's MLP (GLM-4.1V's): ``ProjectorConfig.intermediate_size``.
    decoder_width: bool = False
    # Its named layers' steps in the FLOP model's order (``neva.models.flops``), where they are its own.
    flop_steps: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class VideoRule:
    """How a native family's video takes M-RoPE positions (``neva.models.mrope``), and whether neva's data path
    writes its videos (``served``)."""

    # Qwen3-VL: each frame is its own t = 1 grid (the text puts a timestamp and vision start / end tokens between
    # frames), so every frame starts where the text before it left off.
    per_frame: bool
    # Qwen2.5-VL: the i-th temporal grid sits at ``int(i × tokens_per_second × second_per_grid_t)`` (real time);
    # otherwise at i.
    timed: bool
    # False: the data path refuses the family's videos (Qwen3-VL's per-frame timestamp text is not written yet).
    served: bool = True


@dataclass(frozen=True)
class TowerSpec:
    """One vision family.

    Attributes:
        kind: ``VisionConfig.kind``.
        tower: the tower class (``neva.models``): ``features``, ``empty_input``, ``init_weights``.
        front_end: the factory of the data front end (``neva.data``): ``(model, image_aspect_ratio, min_pixels,
            max_pixels) -> FrontEnd``.
        interop: the HF whole-model interop of a model with this tower (``neva.checkpoint``): the llava-hf wrappers or
            the family's own transformers classes (``Interop``: ``config_dict``, ``read_config``, ``name``).
        acts: the MLP activations its blocks may use (the first is the default of a new config).
        class_tokens: class tokens prepended to its patches (CLIP 1).
        mean, std: its image statistics; eps: its norms' epsilon; select: the hidden state LLaVA's features read when
            none is given.
        patch_grid: it reads each item at its own resolution: a variable number of patches per item, flattened
            ``[L, C·T·P·P]`` with the item's (t, h, w) ``grid`` (no fixed count per image).
        fit: fixed-size towers: how an image fits the square input (``neva.data.images``).
        tiles: a fixed-size tower whose front end tiles every image by its own rule (InternVL): the tower inputs of
            an image, ``(size, tile) -> int`` with ``size`` its (height, width), or None for the rule's largest
            count (``neva.data``; what the planner counts).
        merger: a patch-grid tower's merger (its projector type).
        projector: the class of a merger that is not the Qwen towers' ``PatchMerger`` (``neva.models``; built from
            its ``ProjectorConfig``, mapping ``VisualFeatures``); None: ``neva.models.projector_merger.NativeMerger``.
        projector_plan: the tensor-parallel plan of that class where the generic one (by its layers' kinds) does not
            hold (``neva.parallel``; ``(projector) -> {module name: ParallelStyle}``).
        video: a patch-grid tower's video rule (None: it takes no video as temporal patches).
        pixels: a patch-grid tower's (min_pixels, max_pixels) when the config gives none.
        native_sizes: a patch-grid tower that sizes its images by its own rule instead of the Qwen pixel budget
            (Pixtral's longest edge; ``neva.data``): ``(vision, size) -> (height, width, positions, features)``:
            the resized image, its decoder positions and the offsets among them its features take (``[M]``), for
            ``size`` (height, width) or None (the largest image); what the planner and the rehearsal count.
        window_attention: blocks outside ``fullatt_block_indexes`` attend within windows (Qwen2.5-VL).
        gated_mlp: its MLP is gated (SwiGLU: gate, up, their product), which the planner's activation count reads.
        hf_model_type: the HF vision config ``model_type`` of a llava-hf tower, its field defaults, and LLaVA's
            ``vision_feature_select_strategy`` per ``vision_select_feature``.
        hf_export_fields: fields an HF vision config of this tower is written with besides the shared ones.
        hf_image_processor: the transformers image processor class of a llava-hf tower and how it sizes an image
            (``crop``: the short side, then a centre crop; ``square``: resized to the square).
        llava_original: LLaVA's own code loads the tower (its CLIPVisionTower), so a LLaVA-original export can hold it.
        llava_next_shortened: LLaVA-NeXT's tower class for it deletes the last layer and reads the one before,
            whatever ``mm_vision_select_layer`` says (its ``SigLipVisionTower``).
        block_options: its blocks read ``VisionConfig.norm_type``, ``qk_norm`` and ``qkv_bias`` (InternViT); every
            other tower refuses values other than their defaults.
        image_text_tokens: tokens the family's image text holds besides the image token, by the ``NevaConfig`` field
            of their id (Pixtral's ``[IMG_BREAK]``, ``[IMG_END]``); a fresh model's tokenizer gets those it lacks.
        template: the family's own conversation template class (``neva.data.templates.<family>``): its ``name`` is
            the ``conv_template`` that selects it, its ``image_token`` / ``image_block`` how an image is written, its
            ``jinja_body`` what an export ships (``neva.data.templates.registry`` lists it).
        presets: the family's named tower shapes (``model.mm_cfg.vision_encoder.preset``), each a dict of
            ``VisionConfig`` fields of this ``kind``, as plain data (this package sits below ``neva.models``);
            ``neva.models.presets.VISION_PRESETS`` gathers them with the generic ones and refuses a name twice.
        check: the family's own config checks (a ``VisionConfig``; raises ``ValueError``).
    """

    kind: str
    tower: str
    front_end: str
    interop: str
    acts: tuple[str, ...]
    class_tokens: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    eps: float
    select: int
    patch_grid: bool = False
    fit: str | None = None
    tiles: str | None = None
    merger: MergerSpec | None = None
    projector: str | None = None
    projector_plan: str | None = None
    video: VideoRule | None = None
    pixels: tuple[int, int] | None = None
    native_sizes: str | None = None
    window_attention: bool = False
    gated_mlp: bool = False
    hf_model_type: str | None = None
    hf_defaults: dict[str, Any] | None = None
    hf_select: dict[str, str] | None = None
    hf_export_fields: dict[str, Any] | None = None
    hf_image_processor: tuple[str, str] | None = None
    llava_original: bool = False
    llava_next_shortened: bool = False
    block_options: bool = False
    image_text_tokens: dict[str, str] | None = None
    template: str | None = None
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    check: Callable[[Any], None] | None = None

    def parts(self) -> dict[str, str]:
        """The code parts this spec names, by field (what ``tests/test_dependencies.py`` checks)."""
        return {name: getattr(self, name) for name in PART_OWNERS if getattr(self, name, None)}
