"""``DataConfig``: the ``model.data.*`` keys of NeMo NeVA, typed and validated when the run starts."""

from __future__ import annotations

import os
from dataclasses import dataclass

from neva.constants import MAX_IMAGE_PIXELS
from neva.data.builtin_sets import BUILTIN_SETS
from neva.data.encoding import TOKENIZATIONS
from neva.data.records import expand_shard_spec, is_shard_spec
from neva.data.templates.registry import TEMPLATE_CLASSES
from neva.data.video_decode import MAX_FRAME_PIXELS, MAX_VIDEO_BYTES, MAX_VIDEO_SECONDS, VideoLimits
from neva.data.visual_budget import VISUAL_BUDGET_ACTIONS
from neva.models.anyres import parse_aspect_ratio

TEMPLATES = tuple(TEMPLATE_CLASSES)  # the conversation templates, one table (neva.data.conversation)
# anyres: LLaVA-NeXT tiles (the model's image_grid_pinpoints); anyres_max_N (LLaVA-OneVision) too, its features
# pooled down to about N tiles (neva.models.anyres.pool_grid)
ASPECT_RATIOS = ("square", "pad", "keep", "anyres")
IMAGE_TOKEN_PLACEMENTS = ("front", "inline")
SYNTHETIC = "synthetic"
MEDIA_TYPES = ("image", "video")


@dataclass
class DataConfig:
    """Where the data lives and how it becomes batches.

    Key names follow NeMo NeVA's ``model.data`` (``data_path``, ``image_folder``, ``conv_template``,
    ``image_aspect_ratio``, ``concat_sampling_probabilities``); everything else is neva's.

    Attributes:
        data_path: LLaVA JSON/JSONL file(s), ``.tar`` shards (``/data/llava-{000000..000123}.tar``, streamed; see
            ``neva.data.shards``), or ``"synthetic"`` for the built-in shapes set (``"synthetic_skills"``: the canary's
            skills suite; ``neva.data.builtin_sets``). A list is a blend.
        image_folder: directory or ``.tar`` of images that records' ``image`` paths are relative to.
        conv_template: one of ``TEMPLATES``; None in a run config = from ``model.mm_cfg.llm.model_type`` (NeMo's
            default), resolved by ``neva.config.ModelConfig``.
        image_aspect_ratio: ``square`` (CLIP resize + centre crop), ``pad`` (centre on a mean-colour square first,
            as LLaVA-1.5) or ``keep`` (whole image, longer side resized, mean-colour borders; no crop).
        concat_sampling_probabilities: blend weights, one per ``data_path`` entry (None = proportional to size).
        max_skip_fraction: the run stops when more than this fraction of the samples seen were skipped.
        seq_length: longest token sequence (None = the model's ``max_seq_len``).
        pad_to_multiple_of: padded batch / packed row lengths are rounded up to this.
        packing: pack each micro-batch's samples first-fit into rows of ``seq_length``.
        max_tokens_per_micro_batch: micro-batches filled to this many decoder tokens (text and visual; padded
            ``rows × longest`` unpacked, the samples' sum packed) instead of ``micro_batch_size`` samples: an optimizer
            step still trains ``global_batch_size`` samples, in as many micro-batches as the budget makes
            (``neva.data.token_budget``); None: fixed micro-batches. At least the sequence length.
        group_by_modality_length: LLaVA's sampler (``get_modality_length_grouped_indices``): every global batch one
            modality (but a last mixed one), its contents random, lengths balanced across its micro-batches.
        group_by_length: neva's sampler: every global batch one modality and similar lengths (sorted within 8
            global batches; less padding, length-correlated batches). Not both.
        num_workers: DataLoader worker processes per rank, or ``auto``: on CUDA the CPUs this rank may use (its
            affinity divided among the node's ranks) minus one for the training loop, at most 8; on CPU 0, since the
            model computes on the same cores. Workers persist across epochs and validations.
        prefetch_factor: micro-batches each worker prepares ahead (with workers only).
        image_token_placement: ``front`` moves ``<image>`` tags to the start of their turn followed by a newline
            (LLaVA); ``inline`` leaves them where the data put them.
        tokenization: ``neva`` (one tokenizer call on the rendering, as HF's ``LlavaProcessor``; learned = replies
            and end-of-turn text) or ``llava`` (what LLaVA's trainer feeds its models: ``tokenizer_image_token`` ids,
            each chunk after ``<image>`` tokenized on its own so it starts with the dummy-prefix piece, and the space
            before each reply learned too). Recorded in checkpoints; ``neva.generate`` serves with the same ids
            (docs/DATA.md).
        validation_data_path: optional held-out file(s); synthetic data has its own held-out split.
        val_fraction: fraction of the training records held out when no validation path is given (0 = none).
        synthetic_task: ``caption`` (pretraining), ``qa`` (multi-turn instructions) or ``auto``
            (``caption`` for the ``plain`` template, else ``qa``).
        synthetic_seed / synthetic_train_samples / synthetic_val_samples: size and seed of the built-in set.
        skip_check_min_samples: samples to see before the skip fraction is enforced (one bad sample in the first
            micro-batch must not stop a run).
        system_prompt: overrides the template's default system prompt (None = the template's).
        use_chat_template: for ``mistral``/``llama_3``/``chatml``, render with the tokenizer's chat template if it
            has one (else the documented format).
        shard_shuffle_buffer: samples of a ``.tar`` shard are read in shard order (0) or through a deterministic
            shuffle buffer of this many samples; shards themselves are shuffled every epoch.
        max_image_pixels: an image with more pixels (width × height, read from its header) is skipped as
            ``image_too_large`` before it is decoded.
        min_pixels / max_pixels: a native-resolution tower's pixel budget per image (Qwen-VL's processor keys): each
            image is resized, aspect ratio kept, to sides that are multiples of patch × merge with min_pixels ≤ h·w ≤
            max_pixels (``neva.data.qwen_images.smart_resize``); None: the tower kind's defaults. Not read by
            fixed-size towers.
        media_type: NeMo's key: ``image`` or ``video``. Records are read per record whatever it says (a record's
            ``"video"`` key makes it a video sample, mixed freely with image and text-only ones); ``video`` also
            requires a model that takes video (``neva.data.video``).
        num_frames: frames sampled per video (NeMo's key): uniformly, LLaVA-NeXT-Video's
            ``np.linspace(0, total - 1, num_frames)`` (``neva.data.video_decode``).
        video_fps: one frame every ``1 / video_fps`` s instead (LLaVA-NeXT's ``video_fps``), at most ``num_frames``
            (more → the uniform rule); None = uniform.
        video_folder: directory that records' ``video`` paths are relative to (NeMo's key); None = ``image_folder``.
        max_visual_tokens: a sample's visual positions at most, over all its images and videos together (Qwen's
            ``VIDEO_TOTAL_PIXELS`` for every medium); None: no budget (``neva.data.visual_budget``).
        visual_budget_action: what a record past ``max_visual_tokens`` becomes: ``skip`` (counted as
            ``visual_budget``), ``fewer_frames`` (its videos keep fewer frames) or ``downscale`` (native-resolution
            towers: its images and frames under a lower ``max_pixels``; AnyRes: its images resized to fewer tiles);
            one that still does not fit is skipped.
        max_video_bytes / max_video_seconds / max_video_frame_pixels: a video file larger, longer or with larger
            frames (from its size and header) is skipped before any frame is decoded (``video_too_large`` /
            ``video_too_long``).
    """

    data_path: str | list[str] = SYNTHETIC
    image_folder: str | None = None
    conv_template: str | None = "vicuna_v1"
    image_aspect_ratio: str = "square"
    concat_sampling_probabilities: list[float] | None = None
    max_skip_fraction: float = 0.01
    seq_length: int | None = None
    pad_to_multiple_of: int = 64
    packing: bool = False
    max_tokens_per_micro_batch: int | None = None
    group_by_modality_length: bool = False
    group_by_length: bool = False
    num_workers: int | str = "auto"
    prefetch_factor: int = 2
    image_token_placement: str = "front"
    tokenization: str = "neva"
    validation_data_path: str | list[str] | None = None
    val_fraction: float = 0.0
    synthetic_task: str = "auto"
    synthetic_seed: int = 0
    synthetic_train_samples: int = 2000
    synthetic_val_samples: int = 200
    system_prompt: str | None = None
    use_chat_template: bool = True
    skip_check_min_samples: int = 200
    shard_shuffle_buffer: int = 0
    max_image_pixels: int = MAX_IMAGE_PIXELS
    min_pixels: int | None = None
    max_pixels: int | None = None
    media_type: str = "image"
    num_frames: int = 8
    video_fps: float | None = None
    video_folder: str | None = None
    max_video_bytes: int = MAX_VIDEO_BYTES
    max_video_seconds: float = MAX_VIDEO_SECONDS
    max_video_frame_pixels: int = MAX_FRAME_PIXELS
    max_visual_tokens: int | None = None
    visual_budget_action: str = "skip"

    def __post_init__(self) -> None:
        if self.conv_template is not None and self.conv_template not in TEMPLATES:
            raise ValueError(f"model.data.conv_template={self.conv_template!r} is unknown; choose one of {TEMPLATES}")
        if self.image_aspect_ratio not in ASPECT_RATIOS and parse_aspect_ratio(self.image_aspect_ratio) is None:
            raise ValueError(
                f"model.data.image_aspect_ratio={self.image_aspect_ratio!r}; choose one of {ASPECT_RATIOS} "
                "or anyres_max_N (LLaVA-OneVision)"
            )
        if self.image_token_placement not in IMAGE_TOKEN_PLACEMENTS:
            raise ValueError(
                f"model.data.image_token_placement={self.image_token_placement!r}; choose one of {IMAGE_TOKEN_PLACEMENTS}"
            )
        if self.tokenization not in TOKENIZATIONS:
            raise ValueError(f"model.data.tokenization={self.tokenization!r}; choose one of {TOKENIZATIONS}")
        if self.synthetic_task not in ("auto", "caption", "qa"):
            raise ValueError(f"model.data.synthetic_task={self.synthetic_task!r}; choose auto, caption or qa")
        if not 0.0 <= self.max_skip_fraction <= 1.0:
            raise ValueError(f"model.data.max_skip_fraction must be in [0, 1], got {self.max_skip_fraction}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"model.data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.pad_to_multiple_of < 1:
            raise ValueError(f"model.data.pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")
        if self.seq_length is not None and self.seq_length < 2:
            raise ValueError(f"model.data.seq_length must be >= 2, got {self.seq_length}")
        if (self.min_pixels or 1) < 1 or (self.min_pixels or 0) > (self.max_pixels or float("inf")):
            raise ValueError(
                f"model.data.min_pixels={self.min_pixels} / max_pixels={self.max_pixels}: need 1 <= min <= max"
            )
        if self.max_image_pixels < 1:
            raise ValueError(f"model.data.max_image_pixels must be >= 1, got {self.max_image_pixels}")
        if self.num_workers != "auto" and (not isinstance(self.num_workers, int) or self.num_workers < 0):
            raise ValueError(f"model.data.num_workers must be auto or an integer >= 0, got {self.num_workers!r}")
        if self.prefetch_factor < 1:
            raise ValueError(f"model.data.prefetch_factor must be >= 1, got {self.prefetch_factor}")
        if self.shard_shuffle_buffer < 0:
            raise ValueError(f"model.data.shard_shuffle_buffer must be >= 0, got {self.shard_shuffle_buffer}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"model.data.max_tokens_per_micro_batch must be >= 1 or null, got {self.max_tokens_per_micro_batch}"
            )
        if self.group_by_modality_length and self.group_by_length:
            raise ValueError(
                "model.data.group_by_modality_length (LLaVA's) and model.data.group_by_length (neva's) are both true; "
                "choose one"
            )
        paths = self.data_paths
        if not paths:
            raise ValueError("model.data.data_path is empty; give a LLaVA JSON/JSONL file, shards or 'synthetic'")
        for path in [*paths, *self.validation_paths]:
            missing = None if path in BUILTIN_SETS else _missing(path)
            if missing is not None:
                which = "" if missing == path else f" ({missing} is missing)"
                raise FileNotFoundError(f"model.data.data_path entry {path!r} does not exist{which}")
        if any(is_shard_spec(p) for p in paths):
            # Both need every record up front (a random held-out subset / every record's length), which streaming
            # shards exist to avoid.
            if self.max_tokens_per_micro_batch is not None:
                raise ValueError(
                    "model.data.max_tokens_per_micro_batch needs every record's length before the epoch starts, which "
                    ".tar shards do not give (they stream); set it to null or give the records as JSON"
                )
            for key in ("group_by_modality_length", "group_by_length"):
                if getattr(self, key):
                    raise ValueError(
                        f"model.data.{key}=true needs every record's length before the epoch starts, which .tar "
                        f"shards do not give (they stream); set model.data.{key}=false (shards are read in shuffled "
                        "shard order, see model.data.shard_shuffle_buffer) or give the records as JSON"
                    )
            if self.val_fraction > 0 and not self.validation_paths:
                raise ValueError(
                    "model.data.val_fraction cannot hold out samples from .tar shards; "
                    "set model.data.validation_data_path (held-out shards or a JSON file)"
                )
        if self.image_folder is not None and not os.path.exists(self.image_folder):
            raise FileNotFoundError(f"model.data.image_folder {self.image_folder!r} does not exist")
        self._check_video()
        if self.concat_sampling_probabilities is not None:
            probs = list(self.concat_sampling_probabilities)
            if len(probs) != len(paths):
                raise ValueError(
                    f"model.data.concat_sampling_probabilities has {len(probs)} entries for {len(paths)} data paths"
                )
            if any(p < 0 for p in probs) or abs(sum(probs) - 1.0) > 1e-6:
                raise ValueError(f"model.data.concat_sampling_probabilities must be >= 0 and sum to 1, got {probs}")

    def _check_video(self) -> None:
        if self.media_type not in MEDIA_TYPES:
            raise ValueError(f"model.data.media_type={self.media_type!r}; choose one of {MEDIA_TYPES}")
        if self.video_folder is not None and not os.path.isdir(self.video_folder):
            raise FileNotFoundError(f"model.data.video_folder {self.video_folder!r} is not a directory")
        for key in ("num_frames", "max_video_bytes", "max_video_seconds", "max_video_frame_pixels"):
            if not getattr(self, key) > 0:
                raise ValueError(f"model.data.{key} must be > 0, got {getattr(self, key)}")
        if self.max_visual_tokens is not None and self.max_visual_tokens < 1:
            raise ValueError(f"model.data.max_visual_tokens must be >= 1 or null, got {self.max_visual_tokens}")
        if self.visual_budget_action not in VISUAL_BUDGET_ACTIONS:
            raise ValueError(
                f"model.data.visual_budget_action={self.visual_budget_action!r}; choose one of {VISUAL_BUDGET_ACTIONS}"
            )
        if self.video_fps is not None and not self.video_fps > 0:
            raise ValueError(f"model.data.video_fps must be > 0 or null, got {self.video_fps}")

    @property
    def video_limits(self) -> VideoLimits:
        """How videos are sampled and what a video file may be."""
        return VideoLimits(
            self.num_frames, self.video_fps, self.max_video_bytes, self.max_video_seconds, self.max_video_frame_pixels
        )

    @property
    def data_paths(self) -> list[str]:
        """``data_path`` as a list."""
        return [self.data_path] if isinstance(self.data_path, str) else list(self.data_path)

    @property
    def validation_paths(self) -> list[str]:
        """``validation_data_path`` as a list (empty when unset)."""
        if self.validation_data_path is None:
            return []
        vp = self.validation_data_path
        return [vp] if isinstance(vp, str) else list(vp)

    @property
    def resolved_synthetic_task(self) -> str:
        """``caption`` or ``qa``."""
        if self.synthetic_task != "auto":
            return self.synthetic_task
        return "caption" if self.conv_template == "plain" else "qa"


def _missing(path: str) -> str | None:
    """The first file a ``data_path`` entry names that does not exist (None if all do)."""
    names = expand_shard_spec(path) if is_shard_spec(path) else [path]
    return next((name for name in names if not os.path.exists(name)), None)
