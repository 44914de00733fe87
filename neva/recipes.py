"""The published recipes neva ships (``+preset=``) as a Markdown table: source, layout and the planner's predicted
throughput on the cluster the preset names, computed as ``neva.plan +preset=<name>`` computes them.

``python -m neva.recipes`` prints it; the README carries the same table (``tests/test_front_door.py`` compares
them), so a preset's layout or the planner's model cannot change without the README following.
"""

from __future__ import annotations

import sys
from pathlib import Path

from neva.config import CONFIG_DIR, compose_config
from neva.planner.plan import plan_run
from neva.planner.preset_layout import preset_frames

# Preset name prefix → where the recipe was published (each value's file and line: docs/PRESETS.md). Longest first:
# ``nemo_launcher_`` before ``nemo_``.
SOURCES = (
    ("llava15_", "LLaVA-1.5 (haotian-liu/LLaVA scripts/v1_5)"),
    ("llava_onevision_", "LLaVA-OneVision (LLaVA-VL/LLaVA-NeXT scripts/train)"),
    ("llava_next_dpo_", "LLaVA-NeXT DPO (LLaVA-VL/LLaVA-NeXT scripts/train/dpo.sh)"),
    ("llava_video_", "LLaVA-Video (LLaVA-VL/LLaVA-NeXT scripts/video/train)"),
    ("qwen_vl_finetune_", "Qwen2.5-VL qwen-vl-finetune (QwenLM/Qwen2.5-VL scripts/sft_7b.sh)"),
    ("megatron_bridge_", "Megatron-Bridge (NVIDIA-NeMo/Megatron-Bridge recipes/qwen_vl/qwen25_vl.py)"),
    ("trl_sft_vlm_", "TRL's Gemma 3 VLM SFT (huggingface/trl examples/scripts/sft_vlm_gemma3.py)"),
    ("internvl3_finetune_", "InternVL 3 finetune (OpenGVLab/InternVL internvl_chat/shell/internvl3.0/2nd_finetune)"),
    ("easyr1_", "EasyR1 geometry3k GRPO (hiyouga/EasyR1 examples/qwen2_5_vl_7b_geo3k_grpo.sh)"),
    (
        "llamafactory_vl_sft_",
        "GLM-4.1V full SFT (zai-org/GLM-V README: LLaMA-Factory examples/train_full/qwen2_5vl_full_sft.yaml)",
    ),
    ("axolotl_", "Axolotl's Mistral Small 3.1 vision LoRA (axolotl-ai-cloud/axolotl examples/mistral/mistral-small)"),
    ("nemo_launcher_", "NeMo-Framework-Launcher NeVA (current)"),
    ("nemo_", "NeMo 1.x NeVA (2023 examples)"),
)


def presets() -> list[str]:
    return sorted(p.stem for p in (Path(CONFIG_DIR) / "preset").glob("*.yaml"))


def source(name: str) -> str:
    return next(label for prefix, label in SOURCES if name.startswith(prefix))


def layout_text(plan, cluster: str) -> str:
    """The layout as a reader sets it: nodes, model parallelism, data-parallel mode, checkpointing, batches."""
    lay, nodes = plan.deployment.layout, plan.deployment.nodes
    tp = f"TP {lay.tp}" + (" + SP" if lay.sp else "")
    dp = f"FSDP2 ZeRO-{lay.zero_stage}" if lay.data_parallel == "fsdp" else "DDP"
    parts = [f"{nodes} × {cluster}", tp, f"PP {lay.pp}", f"DP {lay.dp} {dp}"]
    if lay.ep > 1:
        parts.append(f"EP {lay.ep}")
    if lay.cp > 1:
        parts.append(f"CP {lay.cp}")
    parts.append(f"act. ckpt {lay.ac or 'off'}")
    parts.append(f"mbs {lay.micro_batch_size} / gbs {lay.global_batch_size}")
    return ", ".join(parts)


def table() -> str:
    lines = ["| preset | source | layout | predicted samples/s (MFU) |", "|---|---|---|---|"]
    for name in presets():
        cfg = compose_config([f"+preset={name}"])
        plan = plan_run(cfg, num_frames=preset_frames(cfg))  # a video preset on its own samples' frames
        speed = f"{plan.samples_per_s:.1f} ({100 * plan.mfu:.1f}%)"
        lines.append(f"| `{name}` | {source(name)} | {layout_text(plan, cfg.cluster.name)} | {speed} |")
    return "\n".join(lines)


def main() -> None:
    sys.stdout.write(table() + "\n")


if __name__ == "__main__":
    main()
