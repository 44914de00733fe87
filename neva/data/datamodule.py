"""``NevaDataModule``: DataConfig + tokenizer + model shapes → resumable train / val dataloaders for one data-parallel
rank (sampling is by dp rank here, so the Trainer runs with ``use_distributed_sampler=False``).

Who uses it: ``neva.training.run`` builds one and hands it to the LightningModule (``neva.training.module``), which
holds it; the module's ``train_dataloader`` / ``val_dataloader`` hooks wrap this object's loaders, and its checkpoint
hooks store ``state_dict()`` and give it back to ``load_state_dict`` on resume, so the next batch is the exact next
sample. The Trainer itself never sees this object. ``skip_tracker.metrics()`` gives the skip counts to log; the train
loader raises ``DataQualityError`` when more than ``max_skip_fraction`` of the samples are skipped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from neva.constants import IMAGE_TOKEN
from neva.data.builtin_sets import BUILTIN_SETS
from neva.data.collate import Collator
from neva.data.config import DataConfig
from neva.data.dataset import ConversationDataset, EncoderSettings
from neva.data.front_ends import FrontEnd, front_end_for
from neva.data.images import CallableImageSource, image_source_for
from neva.data.records import is_shard_spec, load_records
from neva.data.sampler import ResumableBatchSampler
from neva.data.shards import ShardDataset
from neva.data.skips import SkipTracker
from neva.data.stream_sampler import StreamingBatchSampler, source_layout
from neva.data.templates.registry import get_template, image_token_for
from neva.data.token_budget import TokenBudgetBatchSampler
from neva.data.tokens import tokenizer_image_token_id
from neva.data.video import VideoSource
from neva.data.visual_budget import VisualBudget
from neva.models.anyres import anyres_on, parse_aspect_ratio
from neva.models.config import NevaConfig, VisionConfig
from neva.typed import ConfigError


class ResumableLoader:
    """A DataLoader driven by a ``ResumableBatchSampler`` that records each batch as it reaches the training loop.

    Counting at hand-over (not when the sampler is read) is what makes resume exact: workers prefetch ahead, but
    only delivered batches advance the state.
    """

    def __init__(self, loader: DataLoader, sampler: ResumableBatchSampler, tracker: SkipTracker | None) -> None:
        self.loader = loader
        self.sampler = sampler
        self.tracker = tracker
        self.closes_step = False  # the batch last yielded is its optimizer step's last

    def __len__(self) -> int:
        return len(self.sampler)

    def steps_left(self) -> int:
        """Optimizer steps the next ``__iter__`` yields."""
        return self.sampler.steps_left()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            self.sampler.advance(1)
            self.closes_step = self.sampler.closes_step
            if self.tracker is not None:
                self.tracker.update(batch.counts)
            yield batch


# More workers than this rarely help one GPU (LLaVA used 4): each holds a process's memory.
MAX_AUTO_WORKERS = 8


def resolve_num_workers(num_workers: int | str, device_type: str) -> int:
    """``model.data.num_workers`` as a number: ``auto`` is 0 on CPU (the model computes on the same cores; workers
    would take them from it) and on CUDA the CPUs this rank may use (its affinity shared with the node's other
    ranks, ``LOCAL_WORLD_SIZE``) minus one for the training loop, at most ``MAX_AUTO_WORKERS``."""
    if num_workers != "auto":
        return int(num_workers)
    if device_type != "cuda":
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_rank = cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(0, min(MAX_AUTO_WORKERS, per_rank - 1))


def pad_token_id(tokenizer: Any) -> int:
    """Padding id (pad, else eos, else 0): its value never matters, labels there are ignored."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


class NevaDataModule:
    """Train / val dataloaders for one data-parallel rank.

    Args:
        cfg: data config.
        tokenizer: HF fast tokenizer with ``<image>`` as a special token.
        model_config: the model's config (gives vision shapes, max length and the image token id to check), or None
            with ``vision`` and ``seq_length`` given.
        vision: vision config when ``model_config`` is None (None = text-only).
        seq_length: max tokens when neither ``cfg.seq_length`` nor ``model_config`` gives it.
        micro_batch_size: samples per micro-batch.
        dp_rank: data-parallel rank (same for all TP/PP ranks of a replica).
        dp_world: data-parallel size.
        seed: sampling seed.
        val_micro_batch_size: defaults to ``micro_batch_size``.
        accumulation: micro-batches per optimizer step; each epoch holds whole steps only.
        device_type: where training runs (``cuda`` pins batches in page-locked memory, and ``num_workers: auto``
            starts workers only there).
        plan_dir: where a streaming blend's epoch plan is built once and memory-mapped by every rank
            (``neva.data.data_plan.shared_plan``); None: each rank plans in memory.
        min_micro_batches: the fewest micro-batches a step filled to a token budget may have (a 1F1B pipeline's
            stages: one each).

    Raises:
        ValueError: inconsistent config (image token id, lengths, ``<image>`` not a special token).
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Any,
        model_config: NevaConfig | None = None,
        *,
        vision: VisionConfig | None = None,
        seq_length: int | None = None,
        micro_batch_size: int = 1,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 1234,
        val_micro_batch_size: int | None = None,
        accumulation: int = 1,
        device_type: str = "cpu",
        plan_dir: str | os.PathLike | None = None,
        min_micro_batches: int = 1,
    ) -> None:
        self.cfg = cfg
        self.min_micro_batches = min_micro_batches
        self.plan_dir = plan_dir
        self.tokenizer = tokenizer
        token = image_token_for(cfg.conv_template)
        try:
            self.image_token_id = tokenizer_image_token_id(tokenizer, token)
        except ValueError as err:  # e.g. a Qwen-VL tokenizer (no <image>) under a LLaVA template
            raise ConfigError(
                f"model.data.conv_template={cfg.conv_template!r} writes images as {token}: {err} (a Qwen-VL "
                "checkpoint takes model.data.conv_template=qwen2_vl or qwen3_vl)"
            ) from None
        if model_config is not None:
            vision = model_config.vision
            if model_config.image_token_id != self.image_token_id:
                raise ValueError(
                    f"model image_token_id {model_config.image_token_id} != tokenizer's {IMAGE_TOKEN} id "
                    f"{self.image_token_id}; build the model config with image_token_id={self.image_token_id}"
                )
            max_len = model_config.llm.max_seq_len
        else:
            max_len = seq_length
        self.seq_length = cfg.seq_length or max_len
        if self.seq_length is None:
            raise ValueError("no sequence length: set model.data.seq_length or pass a model config / seq_length")
        if max_len is not None and self.seq_length > max_len:
            raise ValueError(f"model.data.seq_length {self.seq_length} exceeds the model's max_seq_len {max_len}")
        self.vision = vision
        self.front_end = front_end_for(vision, model_config, cfg.image_aspect_ratio, cfg.min_pixels, cfg.max_pixels)
        self.micro_batch_size = micro_batch_size
        self.val_micro_batch_size = val_micro_batch_size or micro_batch_size
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        self.accumulation = accumulation
        self.num_workers = resolve_num_workers(cfg.num_workers, device_type)
        self.pin_memory = device_type == "cuda"
        model_anyres = getattr(model_config, "anyres", None)
        anyres = anyres_on(cfg.image_aspect_ratio, getattr(model_anyres, "grid_pinpoints", None))
        self.settings = EncoderSettings(
            tokenizer=tokenizer,
            template=get_template(cfg.conv_template, tokenizer, cfg.use_chat_template, cfg.system_prompt),
            image_token_id=self.image_token_id,
            num_image_tokens=self.front_end.image_tokens,
            max_length=self.seq_length,
            image_token_placement=cfg.image_token_placement,
            system_prompt=cfg.system_prompt,
            tokenization=cfg.tokenization,
            visual_budget=self._visual_budget(cfg, vision, anyres),
            **self._video_settings(cfg, model_config, self.front_end),
        )
        if anyres and parse_aspect_ratio(cfg.image_aspect_ratio) != model_anyres.max_num_patches:
            raise ValueError(
                f"model.data.image_aspect_ratio={cfg.image_aspect_ratio!r} pools to "
                f"{parse_aspect_ratio(cfg.image_aspect_ratio)} tiles' features, the model's AnyRes to "
                f"{model_anyres.max_num_patches} (max_num_patches; None: no pooling)"
            )
        # An M-RoPE decoder reads three position axes in every batch, text-only ones too (one shape for every stage).
        mrope = model_config is not None and model_config.llm.mrope_section is not None
        self.collator = Collator(
            pad_token_id(tokenizer), self.seq_length, cfg.pad_to_multiple_of, cfg.packing, 3 if mrope else 1
        )
        self.skip_tracker = SkipTracker(cfg.max_skip_fraction, cfg.skip_check_min_samples)
        self.train_datasets: list[Dataset] = []
        self.val_datasets: list[Dataset] = []
        self.train_sampler: ResumableBatchSampler | None = None
        self._val_loader: ResumableLoader | None = None
        self._pending_state: dict[str, Any] | None = None

    @staticmethod
    def _visual_budget(cfg: DataConfig, vision: VisionConfig | None, anyres: bool) -> VisualBudget | None:
        if cfg.max_visual_tokens is None:
            return None
        if cfg.visual_budget_action == "downscale" and not anyres and (vision is None or not vision.spec.patch_grid):
            raise ConfigError(
                "model.data.visual_budget_action=downscale resizes images whose positions follow from their size "
                "(native-resolution and AnyRes towers); this tower reads fixed-size images: use fewer_frames or skip"
            )
        return VisualBudget(cfg.max_visual_tokens, cfg.visual_budget_action)

    @staticmethod
    def _video_settings(cfg: DataConfig, model_config: NevaConfig | None, front_end: FrontEnd) -> dict[str, Any]:
        """``EncoderSettings``' video fields: records with videos are skipped (``video_unsupported``) when the model
        takes no video, unless ``media_type: video`` says video is what this run is for."""
        video = model_config is not None and model_config.takes_video
        if cfg.media_type == "video" and not video:
            raise ValueError("model.data.media_type=video needs a model that takes video (model.video is not set)")
        if not video:
            return {}
        # A front end that makes a video's inputs itself counts its positions from its frames' size (``NativeImages``).
        tokens = front_end.video_tokens if front_end.reads_videos else model_config.video_tokens
        return dict(video_tokens=tokens, video_token_id=model_config.video_token_id, num_frames=cfg.num_frames)

    def _video_source(self, folder: str | None) -> VideoSource | None:
        """Videos under ``folder``, else ``video_folder``, else ``image_folder`` when it is a directory."""
        if self.settings.video_tokens is None:
            return None
        image_dir = self.cfg.image_folder if self.cfg.image_folder and os.path.isdir(self.cfg.image_folder) else None
        # A front end that reads videos makes the frames its own inputs (``NativeImages``: temporal patches).
        vision = None if self.front_end.reads_videos else self.vision
        return VideoSource(folder or self.cfg.video_folder or image_dir, self.cfg.video_limits, vision)

    # -- datasets -------------------------------------------------------------------------------------------------

    def _dataset(
        self, records: list[dict[str, Any]], images: Callable[[int, int], Any] | None, video_folder: str | None = None
    ) -> ConversationDataset:
        """``images``: a built-in set's image function factory (None = files under ``image_folder``);
        ``video_folder``: a built-in set's (None = ``video_folder`` / ``image_folder``)."""
        if images is not None:
            size = self.vision.image_size if self.vision is not None else 32
            source = CallableImageSource(images(self.cfg.synthetic_seed, size))
        else:
            source = image_source_for(self.cfg.image_folder, self.cfg.max_image_pixels)
        return ConversationDataset(records, self.settings, source, self.front_end, self._video_source(video_folder))

    def _shard_dataset(self, spec: str) -> ShardDataset:
        return ShardDataset.from_spec(
            spec, self.settings, self.front_end, self.cfg.max_image_pixels, self._video_source(None)
        )

    def setup(self, stage: str | None = None) -> None:
        """Read the data files (or generate the synthetic set) and split off validation data (once; ``stage`` is
        ignored: every stage reads the same data)."""
        if self.train_datasets:
            return
        cfg = self.cfg
        task = cfg.resolved_synthetic_task
        for path in cfg.data_paths:
            builtin = BUILTIN_SETS.get(path)
            if builtin is not None:
                seed = cfg.synthetic_seed
                folder = None
                if builtin.videos is not None:  # written once, before any worker reads them
                    folder = cfg.video_folder or builtin.video_folder(seed)
                for datasets, split, n in (
                    (self.train_datasets, "train", cfg.synthetic_train_samples),
                    (self.val_datasets, "val", cfg.synthetic_val_samples),
                ):
                    records = builtin.records(seed, split, n, task)
                    if folder is not None:
                        builtin.videos(seed, records, folder)
                    datasets.append(self._dataset(records, builtin.images, folder))
                continue
            if is_shard_spec(path):
                self.train_datasets.append(self._shard_dataset(path))
                continue
            records = load_records(path)
            if cfg.val_fraction > 0 and not cfg.validation_paths:
                perm = np.random.default_rng([self.seed, 99]).permutation(len(records))
                n_val = max(1, int(len(records) * cfg.val_fraction))
                self.val_datasets.append(self._dataset([records[i] for i in sorted(perm[:n_val])], None))
                records = [records[i] for i in sorted(perm[n_val:])]
            self.train_datasets.append(self._dataset(records, None))
        for path in cfg.validation_paths:
            if is_shard_spec(path):
                self.val_datasets.append(self._shard_dataset(path))
            else:
                self.val_datasets.append(self._dataset(load_records(path), None))

    # -- loaders --------------------------------------------------------------------------------------------------

    def _loader(self, datasets: list[Dataset], sampler: ResumableBatchSampler, tracker: SkipTracker | None):
        dataset = datasets[0] if len(datasets) == 1 else ConcatDataset(datasets)
        workers = self.num_workers
        # Persistent workers: later epochs and every validation reuse the processes instead of forking new ones
        # (the batch sampler runs in this process, so restarting or resuming it still works).
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=self.collator,
            num_workers=workers,
            persistent_workers=workers > 0,
            prefetch_factor=self.cfg.prefetch_factor if workers > 0 else None,
            pin_memory=self.pin_memory,
        )
        return ResumableLoader(loader, sampler, tracker)

    def _lengths(self, datasets: list[Dataset]) -> list[int]:
        return [n for d in datasets for n in d.modality_lengths()]

    def train_dataloader(self) -> ResumableLoader:
        """This rank's training batches, resuming from the loaded state."""
        self.setup()
        if self.train_sampler is None:
            self.train_sampler = self._train_sampler()
            if self._pending_state is not None:
                self.load_state_dict(self._pending_state)
        return self._loader(self.train_datasets, self.train_sampler, self.skip_tracker)

    def _train_sampler(self) -> ResumableBatchSampler:
        rank = dict(
            micro_batch_size=self.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_world=self.dp_world,
            seed=self.seed,
            weights=self.cfg.concat_sampling_probabilities,
            accumulation=self.accumulation,
        )
        if any(isinstance(d, ShardDataset) for d in self.train_datasets):
            # Shards: same rank rule and state, but an order that reads one shard at a time.
            layouts = [source_layout(d) for d in self.train_datasets]
            buffer = self.cfg.shard_shuffle_buffer
            return StreamingBatchSampler(layouts, shuffle_buffer=buffer, plan_dir=self.plan_dir, **rank)
        grouped = self.cfg.group_by_modality_length or self.cfg.group_by_length
        lengths = self._lengths(self.train_datasets) if grouped else None
        grouping = "modality_length" if self.cfg.group_by_modality_length else "length"
        sizes = [len(d) for d in self.train_datasets]
        patches = self._patches(self.train_datasets) if self.dp_world > 1 else None
        budget = self.cfg.max_tokens_per_micro_batch
        if budget is None:
            return ResumableBatchSampler(sizes, lengths=lengths, grouping=grouping, patches=patches, **rank)
        if budget < self.seq_length:
            raise ConfigError(
                f"model.data.max_tokens_per_micro_batch={budget} is below the sequence length {self.seq_length} "
                "(model.data.seq_length, else the model's max_seq_len): a sample of that length would not fit"
            )
        base = ResumableBatchSampler(sizes, lengths=lengths, grouping=grouping, **rank)
        tokens = [n for d in self.train_datasets for n in d.token_lengths()]
        return TokenBudgetBatchSampler(
            base, tokens, budget, self.cfg.packing, self.cfg.pad_to_multiple_of, patches, self.min_micro_batches
        )

    def _patches(self, datasets: list[Dataset]) -> list[int] | None:
        """A native-resolution tower's patches per sample over all ``datasets`` (None unless every one knows them):
        the sampler then balances the tower's work over data-parallel ranks."""
        per = [d.tower_patches() if hasattr(d, "tower_patches") else None for d in datasets]
        return None if not per or any(p is None for p in per) else [n for p in per for n in p]

    def val_dataloader(self) -> ResumableLoader | list:
        """Validation batches in file order (full global batches only, so every rank runs the same steps)."""
        self.setup()
        if not self.val_datasets:
            return []
        if self._val_loader is None:  # one loader, so its persistent workers serve every validation
            sampler = ResumableBatchSampler(
                [len(d) for d in self.val_datasets], self.val_micro_batch_size, self.dp_rank, self.dp_world, self.seed,
                shuffle=False,
            )  # fmt: skip
            self._val_loader = _RestartingLoader(self._loader(self.val_datasets, sampler, None))
        return self._val_loader

    # -- state ----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Sampler position and skip counts."""
        state: dict[str, Any] = {"skips": self.skip_tracker.state_dict()}
        if self.train_sampler is not None:
            state["sampler"] = self.train_sampler.state_dict()
        elif self._pending_state is not None and "sampler" in self._pending_state:
            state["sampler"] = self._pending_state["sampler"]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore; applied to the sampler now or when the train loader is built."""
        self.skip_tracker.load_state_dict(state_dict.get("skips", {}))
        if self.train_sampler is None:
            self._pending_state = state_dict
        elif "sampler" in state_dict:
            self.train_sampler.load_state_dict(state_dict["sampler"])
            self._pending_state = None


class _RestartingLoader(ResumableLoader):
    """Validation: every pass starts from the first sample."""

    def __init__(self, inner: ResumableLoader) -> None:
        super().__init__(inner.loader, inner.sampler, None)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.sampler.epoch, self.sampler.consumed = 0, 0
        yield from super().__iter__()
