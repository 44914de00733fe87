"""The typed schema of ``python -m neva.train`` configs (NeMo NeVA key names).

Hydra composes YAML from ``neva/configs``; the result is validated here with ``neva.typed.build``, so a misspelled
key in a YAML file or preset fails at start naming the key (a misspelled command-line override is already refused by
Hydra's struct mode, since every key has a default in ``neva.yaml``). NeMo NeVA keys in YAML files get the command
line's treatment first (``apply_nemo_keys``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from neva.data.config import DataConfig
from neva.models.grpo_loss import LOSS_TYPES as GRPO_LOSS_TYPES
from neva.models.grpo_loss import SCALE_REWARDS
from neva.models.loss import LOSS_NORMALIZATIONS
from neva.models.preference_loss import PREFERENCE_LOSSES
from neva.models.trainable import LoraSpec, TrainablePolicy
from neva.nemo_keys import Same, lookup, rewrite_config_keys, rewrite_overrides, split_override, template_for_model_type
from neva.stages import STAGES as STAGE_SPECS
from neva.stages import stage_spec
from neva.typed import ConfigError, build, unknown_key_error, unknown_keys

CONFIG_DIR = str(Path(__file__).resolve().parent / "configs")


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` arguments users set in NeMo (``trainer.*``)."""

    devices: Any = "auto"  # int, list or "auto"
    num_nodes: int = 1
    accelerator: str = "auto"
    precision: Any = "32"  # 32 | bf16-mixed | 16-mixed | bf16 (with model.megatron_amp_O2 for O2)
    max_steps: int = 100  # -1: no step limit (trainer.max_epochs ends the run)
    max_epochs: int = -1  # -1: no epoch limit; with both set, whichever is reached first (Lightning / NeMo)
    val_check_interval: Any = 50  # steps (int) or fraction of an epoch (float)
    limit_val_batches: Any = 10
    log_every_n_steps: int = 10
    gradient_clip_val: float = 1.0
    enable_progress_bar: bool = True
    num_sanity_val_steps: int = 0
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.max_steps != -1 and self.max_steps < 1:
            raise ValueError(
                f"trainer.max_steps must be >= 1 (or -1: no step limit), got {self.max_steps}: "
                "a run of no step trains nothing"
            )
        if self.max_epochs != -1 and self.max_epochs < 1:
            raise ValueError(f"trainer.max_epochs must be >= 1 (or -1: no epoch limit), got {self.max_epochs}")
        if self.max_steps == -1 and self.max_epochs == -1:
            raise ValueError("trainer.max_steps and trainer.max_epochs are both -1: the run would never end")

    def steps_to_train(self, steps_per_epoch: int) -> int:
        """Optimizer steps of the run: ``max_steps``, ``max_epochs × steps_per_epoch``, or the smaller of the two
        when both are set (Lightning's and NeMo's rule: whichever limit is reached first ends the run).

        ``steps_per_epoch`` is the data's whole global batches (the sampler drops a partial last one). The
        learning-rate schedule runs over this count, so a recipe given in epochs decays over whatever data it gets.
        """
        limits = [self.max_steps] if self.max_steps > 0 else []
        if self.max_epochs > 0:
            limits.append(self.max_epochs * steps_per_epoch)
        return min(limits)


@dataclass
class LLMSettings:
    """``model.mm_cfg.llm``."""

    from_pretrained: str | None = None  # local HF Llama directory
    freeze: bool = True
    # NeMo's model_type: picks model.data.conv_template when that is null (neva.nemo_keys.MODEL_TYPE_TEMPLATES);
    # v1 (Vicuna v1, LLaVA-1.5's template) where NeMo's file says llama_2, so neva's default template stays vicuna_v1
    model_type: str = "v1"
    preset: str = "tiny"  # architecture when not loading from_pretrained (neva.models.presets.LLM_PRESETS)
    arch_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class VisionSettings:
    """``model.mm_cfg.vision_encoder``."""

    from_pretrained: str | None = None  # local HF CLIP or SigLIP directory (vision model or the whole CLIP/SigLIP)
    freeze: bool = True
    preset: str = "tiny"
    vision_select_layer: int = -2
    vision_select_feature: str = "patch"
    # NeMo's class_token_length: None = the tower's (CLIP 1, SigLIP 0); a value is checked against the tower at start
    class_token_length: int | None = None
    arch_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class MMConfig:
    """``model.mm_cfg``."""

    llm: LLMSettings = field(default_factory=LLMSettings)
    vision_encoder: VisionSettings = field(default_factory=VisionSettings)
    mm_mlp_adapter_type: str = "mlp2x_gelu"
    freeze_projector: bool = False
    pretrain_mm_mlp_adapter: str | None = None  # LLaVA's mm_projector.bin / .safetensors: the projector's start
    # LLaVA-NeXT AnyRes (with model.data.image_aspect_ratio=anyres): candidate resolutions, the list of
    # [height, width] or LLaVA's "(1x1),...,(3x3)" range in tiles; null = one fixed-size image
    image_grid_pinpoints: list | str | None = None
    mm_patch_merge_type: str = "spatial_unpad"  # flat, spatial or spatial_unpad (with the learned image_newline)
    # Video (LLaVA-NeXT-Video's keys): null = the model takes no video; 1 = frames unpooled (NeMo's Video-NeVA),
    # 2 = LLaVA-NeXT-Video's 2x2 window per frame, pooled before the projector (neva/models/video.py)
    mm_spatial_pool_stride: int | None = None
    mm_spatial_pool_mode: str = "average"  # average or max


# Whose warmup / cosine formula ``model.optim.sched.formula`` selects (neva/training/optim.py, docs/PRESETS.md):
#   neva  neva's own: ceil(ratio * max) warmup steps at (s + 1) / warmup, a hold at the peak for constant_steps,
#         cosine to min_lr;
#   hf    HF's get_cosine_schedule_with_warmup with TrainingArguments' ceil(ratio * max) warmup steps, s / warmup
#         (lr 0 at the first step), cosine to 0 (LLaVA's trainer; no min_lr, no constant steps);
#   nemo  NeMo's CosineAnnealing (WarmupAnnealHoldPolicy): int(ratio * max) warmup steps at (s + 1) / (warmup + 1),
#         cosine to min_lr; with constant_steps > 0 Megatron's variant: s / warmup, cosine over
#         max - warmup - constant steps, then min_lr for the constant steps.
SCHED_FORMULAS = ("neva", "hf", "nemo")
# model.optim.sched.name: cosine annealing by ``formula``, or transformers' linear decay / constant rate after a linear
# warmup (get_linear_schedule_with_warmup, get_constant_schedule_with_warmup: LLaVA-NeXT's DPO runs linear).
HF_ONLY_SCHEDULES = ("linear", "constant_with_warmup")
SCHEDULES = ("CosineAnnealing", "cosine", *HF_ONLY_SCHEDULES)


@dataclass
class SchedConfig:
    """``model.optim.sched``: cosine annealing with linear warmup, by the formula of ``formula``."""

    name: str = "CosineAnnealing"
    warmup_steps: int | None = None
    warmup_ratio: float | None = 0.03  # used when warmup_steps is None (LLaVA's 3%)
    min_lr: float = 0.0
    constant_steps: int = 0
    formula: str = "neva"

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"model.optim.sched.name={self.name!r}; choose one of {SCHEDULES}")
        if self.name in HF_ONLY_SCHEDULES and (self.min_lr or self.constant_steps):
            raise ValueError(
                f"model.optim.sched.name={self.name} is transformers' formula (to 0 with no constant steps); got "
                f"min_lr={self.min_lr}, constant_steps={self.constant_steps}: set them to 0"
            )
        if self.formula not in SCHED_FORMULAS:
            raise ValueError(f"model.optim.sched.formula={self.formula!r}; choose one of {SCHED_FORMULAS}")
        if self.formula == "hf" and (self.min_lr or self.constant_steps):
            raise ValueError(
                "model.optim.sched.formula=hf (HF's get_cosine_schedule_with_warmup) decays to 0 with no constant "
                f"steps; got min_lr={self.min_lr}, constant_steps={self.constant_steps}: set them to 0 or use "
                "formula=nemo"
            )


@dataclass
class OptimConfig:
    """``model.optim``: AdamW (fused where the device supports it); no decay on norms and biases."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    projector_lr: float | None = None  # separate projector learning rate (LLaVA LoRA recipe: 2e-5)
    vision_lr: float | None = None  # separate vision-tower learning rate (LLaVA-NeXT mm_vision_tower_lr: 2e-6)
    sched: SchedConfig = field(default_factory=SchedConfig)

    def __post_init__(self) -> None:
        # The schedule multiplies each rate by min_lr / lr at the end of its decay: above 1, "decay" raises the rate.
        for key, lr in (("lr", self.lr), ("projector_lr", self.projector_lr), ("vision_lr", self.vision_lr)):
            if lr is not None and self.sched.min_lr > lr:
                raise ValueError(
                    f"model.optim.sched.min_lr={self.sched.min_lr} is above model.optim.{key}={lr}; "
                    f"min_lr must be <= {key}"
                )


@dataclass
class LoraConfig:
    """``model.peft.lora_tuning`` (NeMo names; LLaVA-1.5 LoRA: r=128, alpha=256)."""

    adapter_dim: int = 32
    alpha: float = 64.0
    adapter_dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo", "w1", "w2", "w3"])


@dataclass
class PeftConfig:
    """``model.peft``."""

    peft_scheme: str = "none"  # none | lora
    lora_tuning: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if self.peft_scheme not in ("none", "lora"):
            raise ValueError(f"peft_scheme must be none or lora, got {self.peft_scheme!r}")


@dataclass
class DPOConfig:
    """``model.dpo``: the preference stage's objective (``neva.models.preference_loss``, docs/TRAINING.md)."""

    beta: float = 0.1  # TRL's and LLaVA-NeXT's default
    loss_type: str = "sigmoid"  # sigmoid | robust | hinge | ipo
    label_smoothing: float = 0.0  # sigmoid (cDPO) and robust: the assumed share of flipped labels
    sft_weight: float = 0.0  # weight of the chosen reply's mean token NLL (LLaVA-NeXT's gamma, TRL's rpo_alpha)
    # no reference forward in training: the records' ref_chosen_logps / ref_rejected_logps, else one pass before the
    # first step into <exp_dir>/reference_logps.pt (neva.training.reference_logps)
    precompute_ref_log_probs: bool = False

    def __post_init__(self) -> None:
        if self.loss_type not in PREFERENCE_LOSSES:
            raise ValueError(f"model.dpo.loss_type={self.loss_type!r}; choose one of {tuple(PREFERENCE_LOSSES)}")
        if not self.beta > 0:
            raise ValueError(f"model.dpo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"model.dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.sft_weight < 0:
            raise ValueError(f"model.dpo.sft_weight must be >= 0, got {self.sft_weight}")


@dataclass
class RewardSpec:
    """One entry of ``model.grpo.rewards``: a built-in reward's name (``neva.training.grpo_rewards.BUILTIN``) or a user
    function ``module:function`` (called with prompt, completion, record; returns a float or None), and its weight."""

    function: str = "accuracy"
    weight: float = 1.0


@dataclass
class GRPOConfig:
    """``model.grpo``: the online RL stage's rollouts, rewards and objective (``neva.models.grpo_loss``,
    docs/TRAINING.md "Online RL (GRPO)"). Defaults are TRL's ``GRPOConfig``'s except ``loss_type`` (TRL's dapo)."""

    num_generations: int = 4  # G completions sampled per prompt (a group)
    loss_type: str = "grpo"  # grpo (sequence means) | dapo (token-level) | dr_grpo (constant: N x max_new_tokens)
    scale_rewards: str = "group"  # group | batch | none (no std division: Dr. GRPO)
    beta: float = 0.0  # coefficient of the k3 KL to the reference; 0 builds no reference
    kl_ratio_correction: bool = False  # k3 x the policy ratio (TRL's use_bias_correction_kl, its default True)
    epsilon: float = 0.2  # clip's lower bound 1 - epsilon
    epsilon_high: float | None = None  # clip's upper bound 1 + epsilon_high (DAPO's clip-higher: 0.28); None: epsilon
    # dual clip (Ye et al. 2020, EasyR1's clip_ratio_dual: 3.0): a negative advantage's token loss capped at -c * A,
    # so that a ratio far above 1 on a token to be made rarer does not grow its step without bound; None: off
    clip_ratio_dual: float | None = None
    num_iterations: int = 1  # mu: updates per rollout batch, against the log-probs recorded before the first
    max_new_tokens: int = 256  # TRL's max_completion_length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop_strings: list[str] = field(default_factory=list)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec("accuracy", 1.0)])
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal from the update

    def __post_init__(self) -> None:
        if self.loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"model.grpo.loss_type={self.loss_type!r}; choose one of {tuple(GRPO_LOSS_TYPES)}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"model.grpo.scale_rewards={self.scale_rewards!r}; choose one of {SCALE_REWARDS}")
        if self.num_generations < 2:
            raise ValueError(f"model.grpo.num_generations must be >= 2 (a group), got {self.num_generations}")
        if self.num_iterations < 1 or self.max_new_tokens < 1 or self.beta < 0 or not 0 < self.epsilon < 1:
            raise ValueError("model.grpo: num_iterations and max_new_tokens >= 1, beta >= 0, 0 < epsilon < 1")
        if self.clip_ratio_dual is not None and self.clip_ratio_dual <= 1:
            raise ValueError(f"model.grpo.clip_ratio_dual must be > 1 (or null: off), got {self.clip_ratio_dual}")
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("model.grpo: temperature > 0, 0 < top_p <= 1, top_k >= 0")

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class EvalSuiteConfig:
    """One entry of ``model.eval.suites``: a suite of ``neva.evaluate --suite`` (``docs/EVALUATION.md``)."""

    # a benchmark: pope | textvqa | scienceqa | mme | mmbench | mmbench_test | gqa | seed | vqav2 | vizwiz; or a
    # built-in synthetic suite: shapes | skills | detail | video
    name: str = ""
    data_dir: str = ""  # a benchmark's: LLaVA's playground/data/eval (or the benchmark's own folder)
    # a benchmark: only the first questions of the question file (null: all); a synthetic suite: its question count
    # (null: neva.evaluate's default)
    limit: int | None = None
    batch_size: int = 8
    # null: LLaVA's setting for the benchmark (neva/benchmarks/table.py); a synthetic suite: 16 (neva.evaluate's)
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"model.eval.suites: {self.name} limit must be >= 1 or null, got {self.limit}")
        if self.batch_size < 1:
            raise ValueError(f"model.eval.suites: {self.name} batch_size must be >= 1, got {self.batch_size}")


@dataclass
class EvalConfig:
    """``model.eval``: benchmarks answered by the training model every ``every_n_steps`` (0: never), scored as
    ``neva.evaluate`` scores them (``neva/training_eval.py``)."""

    every_n_steps: int = 0
    suites: list[EvalSuiteConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.every_n_steps < 0:
            raise ValueError(f"model.eval.every_n_steps must be >= 0, got {self.every_n_steps}")


@dataclass
class ModelConfig:
    """``model.*``."""

    micro_batch_size: int = 8
    global_batch_size: int = 32
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    pipeline_schedule: str = "1f1b"  # 1f1b | interleaved_1f1b | gpipe
    pipeline_first_stage_layers: int | None = None  # fewer decoder layers on the stage that also runs vision
    sequence_parallel: bool = False
    # MoE experts split over this many data-parallel ranks (Megatron-Core's EP, carved from dp; neva/parallel/
    # expert_parallel.py)
    expert_model_parallel_size: int = 1
    # each sequence split over this many ranks (Megatron's CP: between dp and tp on the mesh;
    # neva/parallel/context_parallel.py)
    context_parallel_size: int = 1
    data_parallel: str = "fsdp"  # fsdp | ddp
    zero_stage: int = 3  # FSDP2: 3 reshards parameters after forward, 2 keeps them
    megatron_amp_O2: bool = False
    activations_checkpoint_granularity: str | None = None  # full | selective
    activations_checkpoint_num_layers: int | None = None
    # what decoder blocks save for backward waits in host memory (neva/parallel/activation_offload.py)
    activation_offload: bool = False
    # FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer states in host memory
    fsdp_offload: bool = False
    # per-block torch.compile: auto = on for CUDA, off elsewhere (CPU compiles slowly and gains little); true | false
    compile: bool | str = "auto"
    meta_init: bool = False  # distributed: allocate and load only each rank's shards (models too large for one rank)
    # Megatron-LM's --distributed-timeout-minutes (default 10): how long any collective or point-to-point transfer
    # waits for its peers before the run fails; fractions allowed (0.1 = 6 s)
    distributed_timeout_minutes: float = 10.0
    restore_from_path: str | None = None
    seed: int = 1234
    # global_tokens (neva: / learned tokens of the whole global batch) | micro_batch_mean (LLaVA/HF and NeMo: mean of
    # each micro-batch, averaged over micro-batches and data-parallel ranks); neva/models/loss.py
    loss_normalization: str = "global_tokens"
    mm_cfg: MMConfig = field(default_factory=MMConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def trainable_policy(self) -> TrainablePolicy:
        """What trains in this stage: vision frozen unless configured, the projector, and the LLM (or its LoRA
        adapters only)."""
        mm, peft = self.mm_cfg, self.peft
        lora = None
        if peft.peft_scheme == "lora":
            t = peft.lora_tuning
            lora = LoraSpec(t.adapter_dim, t.alpha, t.adapter_dropout, tuple(t.target_modules))
        return TrainablePolicy(
            vision=not mm.vision_encoder.freeze, projector=not mm.freeze_projector, llm=not mm.llm.freeze, lora=lora
        )

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "tensor_model_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.pipeline_model_parallel_size < 1:
            raise ValueError("pipeline_model_parallel_size must be >= 1")
        if self.pipeline_schedule not in ("1f1b", "interleaved_1f1b", "gpipe"):
            raise ValueError(
                f"pipeline_schedule must be 1f1b, interleaved_1f1b or gpipe, got {self.pipeline_schedule!r}"
            )
        if self.loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(
                f"model.loss_normalization={self.loss_normalization!r}; choose one of {LOSS_NORMALIZATIONS}"
            )
        if self.data.max_tokens_per_micro_batch is not None and self.loss_normalization != "global_tokens":
            raise ValueError(
                "model.data.max_tokens_per_micro_batch makes the micro-batches of a step vary in number and size: "
                f"model.loss_normalization={self.loss_normalization!r} would weigh their tokens differently; use "
                "global_tokens"
            )
        if self.data_parallel not in ("fsdp", "ddp"):
            raise ValueError(f"data_parallel must be fsdp or ddp, got {self.data_parallel!r}")
        if isinstance(self.compile, str) and self.compile != "auto":
            raise ValueError(f"compile must be auto, true or false, got {self.compile!r}")
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(f"distributed_timeout_minutes must be > 0, got {self.distributed_timeout_minutes}")
        if self.zero_stage not in (2, 3):
            raise ValueError(f"zero_stage must be 2 or 3, got {self.zero_stage}")
        template = template_for_model_type(self.mm_cfg.llm.model_type)
        if self.data.conv_template is None:
            self.data.conv_template = template
        if self.activations_checkpoint_granularity not in (None, "full", "selective"):
            raise ValueError(
                f"activations_checkpoint_granularity must be full, selective or null, "
                f"got {self.activations_checkpoint_granularity!r}"
            )


@dataclass
class CheckpointParams:
    """``exp_manager.checkpoint_callback_params``."""

    every_n_train_steps: int = 50
    save_last: bool = True
    save_top_k: int = 3  # newest step checkpoints kept (NeMo's default count); -1 keeps all, 0 only last.ckpt

    def __post_init__(self) -> None:
        if self.save_top_k < -1:
            raise ValueError(f"save_top_k must be -1 (keep all), 0 or more, got {self.save_top_k}")


@dataclass
class ExpManagerConfig:
    """``exp_manager.*``: where a run writes, and whether it resumes."""

    exp_dir: str = "outputs/pretrain"
    name: str = "neva"
    resume_if_exists: bool = True
    # resume although the config changed what is trained (model, stage, data, global batch, seed, LoRA); by default
    # such a resume stops and lists the changes (neva.training.resume_check)
    resume_ignore_config_changes: bool = False
    # a step checkpoint (file or DCP directory) to resume from instead of the newest one in exp_dir
    resume_from_checkpoint: str | None = None
    create_tensorboard_logger: bool = True
    create_wandb_logger: bool = False
    wandb_logger_kwargs: dict[str, Any] = field(default_factory=dict)
    checkpoint_callback_params: CheckpointParams = field(default_factory=CheckpointParams)


@dataclass
class RecipeStage:
    """Per-stage hyperparameters a model preset carries (interpolated into ``model.*`` by the stage config)."""

    micro_batch_size: int = 8
    global_batch_size: int = 32
    lr: float = 1e-3
    min_lr: float = 0.0
    max_steps: int = 100  # -1: the run's length comes from max_epochs
    max_epochs: int = -1
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0


@dataclass
class RecipeConfig:
    pretrain: RecipeStage = field(default_factory=RecipeStage)
    finetune: RecipeStage = field(default_factory=RecipeStage)
    dpo: RecipeStage = field(default_factory=RecipeStage)


@dataclass
class ClusterConfig:
    """Hardware description, used by ``neva.plan`` and for MFU (peak FLOP/s per device)."""

    name: str = "local"
    gpus_per_node: int = 8
    gpu_name: str = "unknown"
    gpu_memory_gb: float = 80.0
    peak_tflops_bf16: float | None = None
    nvlink_gb_per_s: float = 600.0
    ib_gb_per_s: float = 200.0  # per node, all NICs together (bytes)
    efficiency: dict[str, Any] = field(default_factory=dict)


STAGES = tuple(STAGE_SPECS)


@dataclass
class TrainConfig:
    """The whole composed config of ``python -m neva.train``."""

    stage: str = "pretrain"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    exp_manager: ExpManagerConfig = field(default_factory=ExpManagerConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        stage_spec(self.stage)  # a stage neva has, else its names

    def reference_kind(self) -> str | None:
        """How the stage's reference runs (training and the planner alike): ``frozen`` (a second model),
        ``adapters_off`` (the trained model, LoRA), or None (a stage without one, or one whose settings need no
        reference forward in training: DPO's precomputed log-probs)."""
        uses = stage_spec(self.stage).reference
        if uses is None or not uses(self):
            return None
        return "adapters_off" if self.model.peft.peft_scheme == "lora" else "frozen"


def _leaves(key: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(f"{key}.{k}", v)]
    return [(key, value)]


def _pop(data: dict[str, Any], key: str) -> None:
    """Remove dotted ``key`` from ``data`` and the mappings it leaves empty."""
    head, _, rest = key.partition(".")
    if rest:
        _pop(data[head], rest)
        if data[head]:
            return
    del data[head]


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    head, _, rest = key.partition(".")
    if rest:
        _put(data.setdefault(head, {}), rest, value)
    else:
        data[head] = value


def apply_nemo_keys(data: dict[str, Any], command_line: list[str] | tuple[str, ...] = ()) -> None:
    """NeMo keys that YAML files (a user's ``--config-name``, a preset) brought into the composed ``data`` get the
    command line's treatment (``neva.nemo_keys``): an alias sets its neva key, with its notice, unless the command
    line sets that key itself (the command line wins over files, as in Hydra); a refused key stops with the table's
    reason. Keys the schema has no field for that are not NeMo keys are left for ``build`` to refuse.

    Raises:
        ConfigError: as ``neva.nemo_keys.rewrite_overrides``.
    """
    # Same-named keys are the schema's own; the rest of the table's keys are what it would refuse.
    found = {
        leaf: v
        for key, value in unknown_keys(TrainConfig, data)
        for leaf, v in _leaves(key, value)
        if not isinstance(lookup(leaf), Same | None)
    }
    if not found:
        return
    given = {split_override(o)[1] for o in command_line}
    for key, value in rewrite_config_keys(found).items():
        if key not in given:
            _put(data, key, value)
    for key in found:
        _pop(data, key)


def to_train_config(cfg: DictConfig, command_line: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Resolve interpolations, apply the NeMo key table to keys the YAML files brought, validate against the typed
    schema. ``command_line``: the overrides Hydra applied (NeMo keys already rewritten)."""
    missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra."))
    if missing:
        raise ConfigError(
            f"required key(s) not set: {', '.join(missing)}; give them on the command line, e.g. {missing[0]}=..."
        )
    data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    data.pop("hydra", None)
    apply_nemo_keys(data, command_line)
    return build(TrainConfig, data)


def misspelled_override(err: BaseException) -> ConfigError | None:
    """Hydra's refusal of an override of a key the config lacks ("use +key"), as the schema's own refusal with the
    closest valid names: one round trip for a misspelled key, since ``+key`` would only be refused next (None: any
    other error, or a key under a mapping that takes any key)."""
    match = re.match(r"Could not override '([^']+)'", str(err))
    return None if match is None else unknown_key_error(TrainConfig, match.group(1))


def compose_config(overrides: list[str] | None = None, config_name: str = "neva") -> TrainConfig:
    """The validated config for ``overrides`` (as on the command line, e.g. ``["+stage=pretrain"]``)."""
    overrides = rewrite_overrides(overrides or [])
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        try:
            dcfg = compose(config_name, overrides=overrides)
        except ConfigCompositionException as err:
            raise misspelled_override(err) or err from None
        return to_train_config(dcfg, overrides)
