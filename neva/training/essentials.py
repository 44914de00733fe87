"""The run's first line: the resolved essentials (what it starts from, data, template, learning rate and schedule,
batch, length, layout, precision, a native tower's pixel budget), so a wrong default shows before anything runs."""

from __future__ import annotations

from neva.config import TrainConfig
from neva.parallel.layout import Layout


def essentials_line(cfg: TrainConfig, layout: Layout) -> str:
    """One line of the resolved settings that most change what a run trains."""
    m, d, t = cfg.model, cfg.model.data, cfg.trainer
    mm, sched = m.mm_cfg, m.optim.sched
    if m.restore_from_path is not None:
        start = f"from {m.restore_from_path}"
    elif mm.llm.from_pretrained:
        start = f"HF {mm.llm.from_pretrained}" + (
            f" + {mm.vision_encoder.from_pretrained}" if mm.vision_encoder.from_pretrained else ""
        )
    else:
        start = f"fresh {mm.llm.preset} / {mm.vision_encoder.preset}"
    warmup = f"{sched.warmup_steps} steps" if sched.warmup_steps is not None else f"ratio {sched.warmup_ratio}"
    length = f"{t.max_steps} steps" if t.max_steps > 0 else f"{t.max_epochs} epoch(s)"
    parts = [
        f"stage {cfg.stage}",
        f"model {start}" + (f", LoRA r={m.peft.lora_tuning.adapter_dim}" if m.peft.peft_scheme == "lora" else ""),
        f"data {d.data_path}",
        f"template {d.conv_template}" + ("" if d.system_prompt is None else f" (system prompt {d.system_prompt!r})"),
        f"lr {m.optim.lr:g} {sched.name} ({sched.formula}; warmup {warmup}, min {sched.min_lr:g})",
        f"batch {m.micro_batch_size} micro / {m.global_batch_size} global",
        length,
        f"layout TP {layout.tp} PP {layout.pp} DP {layout.dp} ({layout.data_parallel}) CP {layout.cp} EP {layout.ep}",
        f"precision {t.precision}" + (" O2" if m.megatron_amp_O2 else ""),
    ]
    if d.min_pixels is not None or d.max_pixels is not None:
        parts.append(f"pixels {d.min_pixels}..{d.max_pixels}")
    return "run: " + ", ".join(parts)
