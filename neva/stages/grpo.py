"""The online RL stage (GRPO and its variants: ``model.grpo``): prompts with a checkable answer, a group of sampled
completions per prompt generated inside the run, rewards, group-normalised advantages and the clipped policy
objective, against a reference when ``model.grpo.beta`` > 0 (a frozen copy of the starting weights, or the adapters
switched off under LoRA); from stage two's output. Its step is its own (rollouts, rewards, ``num_iterations``
updates: ``neva.training.grpo_step``), and a prompt is its group's completions in the update."""

from typing import Any

from neva.stages.spec import StageSpec
from neva.typed import ConfigError

# The settings the stage cannot run with, each with why (key, refused value, reason).
REFUSED = (
    ("model.loss_normalization", lambda c: c.model.loss_normalization != "global_tokens",
     "the objective's own normalisation (model.grpo.loss_type) divides the global batch's sum"),
    ("model.data.packing", lambda c: c.model.data.packing, "every completion keeps a row of its own"),
)  # fmt: skip


def check_grpo_config(cfg: Any) -> None:
    """Raises: ConfigError naming the first key the online RL stage cannot run with."""
    for key, refused, why in REFUSED:
        if refused(cfg):
            raise ConfigError(f"stage=grpo: {key} is not supported here: {why}")
    policy = cfg.model.trainable_policy()
    if cfg.model.grpo.beta > 0 and policy.lora is not None and (policy.vision or policy.projector):
        raise ConfigError(
            "stage=grpo with model.grpo.beta > 0 and LoRA takes the model with its adapters off as the reference: set "
            "model.mm_cfg.freeze_projector=true (and keep the tower frozen) so that it stays the starting weights"
        )


GRPO = StageSpec(
    "grpo",
    starts_from=("finetune", "finetuned"),
    text_tokens=450,
    learned_fraction=0.5,
    sequences_per_sample=lambda cfg: cfg.model.grpo.num_generations,
    rollout=lambda cfg: (cfg.model.grpo.num_generations, cfg.model.grpo.max_new_tokens),
    reference=lambda cfg: cfg.model.grpo.beta != 0,
    check=check_grpo_config,
    data_module="neva.training.grpo:prompt_data_module",
    objective="neva.training.grpo:group_policy_objective",
    step="neva.training.grpo_step:rollout_step",
    rehearsal_batches="neva.training.grpo:rehearsal_groups",
    # Its rollout is not rehearsed: the rehearsal runs the update on the plan's sample as prompts' groups.
    rehearses_pipeline=False,
)
