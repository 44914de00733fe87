"""One step of the online RL stage: rollouts of the step's prompts, rewards, group advantages, then ``num_iterations``
optimizer updates on them (``neva.training.grpo``), metrics and the rollouts' file.

A step's prompts are this rank's micro-batches of prompt samples (``neva.data.grpo_prompts``: ``model.micro_batch_size``
prompts each); each micro-batch becomes its ``micro_batch_size × num_generations`` completions, each labelled after
its prompt: one row per prompt holding the prompt once and then each of its completions (``neva.data.grpo_rows``), or
one row per completion where ``neva.training.grpo.shares_prompts`` says the layout or the model cannot take that. Groups never span ranks (a prompt's completions are generated where the prompt is), so the
group statistics are local; ``scale_rewards=batch`` divides by this rank's std.

Sampling is seeded per completion by (``model.seed``, the step, the prompt, its index in the group)
(``neva.training.rollouts.rollout_seed``): a resumed run draws exactly what the uninterrupted one drew, from the data
sampler's saved position alone, and every layout draws the same.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from neva.config import TrainConfig
from neva.constants import IGNORE_INDEX
from neva.data.grpo_prompts import collate_groups, completion_sample
from neva.data.grpo_rows import collate_shared_prompts
from neva.data.micro_batch import MicroBatch, RolloutRows
from neva.data.templates.base import end_of_turn_ids, stop_strings
from neva.models.generation import GenerationConfig
from neva.models.grpo_loss import group_advantages
from neva.training.grpo import record_old_logps, shares_prompts
from neva.training.grpo_rewards import load_rewards, reward_metrics, score
from neva.training.rollouts import InRunRollouts, Rollouts, rollout_seed


def prompt_key(prompt: dict[str, Any], record: dict[str, Any]) -> int:
    """A prompt's identity for its seeds: its record id and token ids (the same on every rank and layout)."""
    return zlib.crc32(str(record.get("id")).encode() + prompt["input_ids"].numpy().tobytes())


def completion_text(tokenizer: Any, ids: list[int], stops: tuple[str, ...]) -> str:
    """Generated ids → the text rewards read: special tokens dropped, cut at the first stop string."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[: min(cuts)] if cuts else text


class GroupRolloutStep:
    """The online RL stage's ``training_step`` body (see the module docstring).

    Args:
        cfg: the run's config (``model.grpo``, ``model.seed``, clipping).
        engine: the training engine, its head objective ``GroupPolicyObjective``.
        tokenizer / template: the run's (completion text, end-of-turn stops).
        pad_id / pad_to_multiple_of: the rows' collation.
        exp_dir: where ``rollouts/step_N.jsonl`` go; None: not written (ranks other than each replica's first).
        rollouts: the completions' source (default: ``InRunRollouts`` on the engine's model).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        engine: Any,
        tokenizer: Any,
        template: Any,
        pad_id: int,
        pad_to_multiple_of: int,
        exp_dir: Path | None,
        rollouts: Rollouts | None = None,
    ) -> None:
        self.cfg = cfg
        self.g = cfg.model.grpo
        self.engine = engine
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.exp_dir = exp_dir
        self.rewards = load_rewards(self.g.rewards)
        self.file_suffix = ""
        self._shared: bool | None = None  # whether the update's rows share prompts (``shares_prompts``), asked once
        self.last_rows: list[tuple[Any, list[int]]] = []
        self.last_updates: list[tuple[float, float | None]] = []
        self.stops = tuple(dict.fromkeys([*stop_strings(template), *self.g.stop_strings]))
        eos = tuple(dict.fromkeys([*end_of_turn_ids(template, tokenizer)]))
        self.eos = eos
        # the media placeholders are never sampled: a completion's image position would ask for features no image gives
        model_cfg = engine.parts[0].cfg
        placeholders = {model_cfg.image_token_id, model_cfg.video_token_id} - {None}
        suppress = tuple(sorted(t for t in placeholders if t < model_cfg.llm.vocab_size))
        decoding = GenerationConfig(
            max_new_tokens=self.g.max_new_tokens, do_sample=True, temperature=self.g.temperature, top_k=self.g.top_k,
            top_p=self.g.top_p, eos_token_ids=eos, stop_strings=self.stops, pad_token_id=pad_id,
            suppress_tokens=suppress,
        )  # fmt: skip
        self.rollouts = rollouts or InRunRollouts(engine, decoding, lambda ids: tokenizer.decode(ids))
        # Held-out prompts: one completion each, sampled as the rollouts sample (a greedy answer of a finetuned model
        # is usually right already: the policy's expected reward is what the stage raises), seeded by the prompt
        # alone, so every validation draws with the same seeds (``val_reward``).
        self._held_out: list[torch.Tensor] = []

    def held_out(self, batch: MicroBatch) -> None:
        """Answer a validation micro-batch's prompts (one sampled completion each) and keep their rewards."""
        prompts, records = batch.stage.prompts, batch.stage.records
        if not prompts:
            return
        seeds = [rollout_seed(self.cfg.model.seed, -1, prompt_key(p, r), 0) for p, r in zip(prompts, records)]
        completions = self.rollouts.sample(prompts, 1, seeds)
        texts = [completion_text(self.tokenizer, ids, self.stops) for ids in completions]
        prompt_texts = [self.tokenizer.decode(p["input_ids"].tolist(), skip_special_tokens=True) for p in prompts]
        values, _ = score(self.rewards, prompt_texts, texts, records, completions, self.g.max_new_tokens)
        self._held_out.append(values)

    def held_out_metrics(self) -> dict[str, float]:
        """``val_reward`` and ``val_rewards/<name>/mean`` over the validation prompts since the last call (this rank's
        and the other data-parallel replicas': summed in one all-reduce)."""
        if not self._held_out:
            values = torch.zeros(0, len(self.rewards))
        else:
            values = torch.cat(self._held_out)
        self._held_out = []
        weights = torch.tensor([r.weight for r in self.rewards])
        sums = torch.cat([(values.nan_to_num(0.0) * weights).sum(1).sum().reshape(1), values.nan_to_num(0.0).sum(0),
                          (~values.isnan()).sum(0).float(), torch.tensor([float(values.shape[0])])])  # fmt: skip
        group = self.engine.dp_group
        if group is not None:
            sums = sums.to(self.engine.device)
            torch.distributed.all_reduce(sums, group=group)
            sums = sums.cpu()
        k = len(self.rewards)
        out = {"val_reward": float(sums[0] / sums[-1].clamp(min=1))}
        for j, r in enumerate(self.rewards):
            out[f"val_rewards/{r.name}/mean"] = float(sums[1 + j] / sums[1 + k + j].clamp(min=1))
        return out

    def run(self, optimizer: Any, scheduler: Any, batches: list[MicroBatch], step: int) -> dict[str, float]:
        """Roll out, score and update; returns the step's metrics (the objective's come from the last update)."""
        group = self.g.num_generations
        start = time.perf_counter()
        rows: list[dict[str, Any]] = []  # one per completion, prompt-major, with what the file and metrics need
        micro_batches = []
        for mb in batches:
            prompts, records = mb.stage.prompts, mb.stage.records
            if not prompts:
                continue
            keys = [prompt_key(p, r) for p, r in zip(prompts, records)]
            seeds = [rollout_seed(self.cfg.model.seed, step, k, j) for k in keys for j in range(group)]
            completions = self.rollouts.sample(prompts, group, seeds)
            made = []
            for i, (prompt, record) in enumerate(zip(prompts, records)):
                for j in range(group):
                    ids = completions[i * group + j]
                    made.append({"prompt": prompt, "record": record, "ids": ids, "key": keys[i],
                                 "text": completion_text(self.tokenizer, ids, self.stops)})  # fmt: skip
            rows += made
            micro_batches.append(made)
        rollout_time = time.perf_counter() - start
        self.last_rows = [(r["record"].get("id"), r["ids"]) for r in rows]  # what the layout tests compare
        self.last_updates: list[tuple[float, float | None]] = []

        prompt_texts = [
            self.tokenizer.decode(r["prompt"]["input_ids"].tolist(), skip_special_tokens=True) for r in rows
        ]
        values, total = score(
            self.rewards, prompt_texts, [r["text"] for r in rows], [r["record"] for r in rows],
            [r["ids"] for r in rows], self.g.max_new_tokens,
        )  # fmt: skip
        advantages, flat = (
            group_advantages(total, group, self.g.scale_rewards)
            if rows
            else (torch.zeros(0), torch.zeros(0, dtype=bool))
        )
        keep = ~flat if self.g.dynamic_sampling else torch.ones_like(flat)

        start = time.perf_counter()
        batches_in = self._row_batches(micro_batches, advantages, keep)
        if self.g.num_iterations > 1:
            batches_in = record_old_logps(self.engine, batches_in)
        metrics: dict[str, float] = {}
        for _ in range(self.g.num_iterations):
            loss, _, grad_norm = self.engine.optimizer_step(
                optimizer, batches_in, self.cfg.trainer.gradient_clip_val, step=step
            )
            scheduler.step()
            self.rollouts.weights_updated()
            metrics["train_loss"] = float(loss)
            if grad_norm is not None:
                metrics["grad_norm"] = float(grad_norm)
            self.last_updates.append((metrics["train_loss"], metrics.get("grad_norm")))
        update_time = time.perf_counter() - start
        metrics.update(self.engine.aux_metrics)
        metrics.update(self._metrics(rows, values, total, advantages, flat, rollout_time, update_time))
        if self.exp_dir is not None:
            self._write(step + self.g.num_iterations, rows, values, total, advantages)  # metrics.csv's row of it
        return metrics

    def _row_batches(
        self, micro_batches: list[list[dict]], advantages: torch.Tensor, keep: torch.Tensor
    ) -> list[MicroBatch]:
        """Each micro-batch's completions as collated rows with their advantages: each prompt shared by its group's
        completions in one row where the layout and model take it (``shares_prompts``, ``neva.data.grpo_rows``),
        else one row per completion (prompt + completion, the completion learned). A completion dropped by dynamic
        sampling keeps its place with nothing learned (every rank runs the same micro-batches)."""
        group = self.g.num_generations
        if self._shared is None:
            self._shared = shares_prompts(self.engine)
        out, offset = [], 0
        for made in micro_batches:
            ids = [torch.tensor(row["ids"], dtype=torch.long) for row in made]
            learned = [c if bool(keep[offset + k]) else torch.full_like(c, IGNORE_INDEX) for k, c in enumerate(ids)]
            mine = advantages[offset : offset + len(made)]
            batch = None
            if self._shared:
                prompts = [row["prompt"] for row in made[::group]]
                batch = collate_shared_prompts(prompts, ids, learned, group, self.pad_id, self.pad_to_multiple_of, mine)
            if batch is None:
                samples = [completion_sample(row["prompt"], c, lab) for row, c, lab in zip(made, ids, learned)]
                batch = collate_groups(samples, group, self.pad_id, self.pad_to_multiple_of)
                batch = batch.with_(stage=RolloutRows(advantages=mine))
            out.append(batch)
            offset += len(made)
        return out

    def _metrics(self, rows, values, total, advantages, flat, rollout_time, update_time) -> dict[str, float]:
        group = self.g.num_generations
        lengths = torch.tensor([float(len(r["ids"])) for r in rows]) if rows else torch.zeros(1)
        ended = [bool(r["ids"]) and (r["ids"][-1] in self.eos or any(s in r["text"] for s in self.stops)) for r in rows]
        truncated = [not e and len(r["ids"]) >= self.g.max_new_tokens for r, e in zip(rows, ended)]
        out = reward_metrics(self.rewards, values, total) if rows else {}
        out.update({
            "advantage_abs_mean": float(advantages.abs().mean()) if rows else 0.0,
            "advantage_std": float(advantages.std()) if len(rows) > 1 else 0.0,
            "frac_reward_zero_std": float(flat.float().view(-1, group)[:, 0].mean()) if rows else 0.0,
            "completion_length": float(lengths.mean()), "completion_length_max": float(lengths.max()),
            "completion_truncated": sum(truncated) / max(1, len(rows)),
            "rollout_time": rollout_time, "update_time": update_time,
        })  # fmt: skip
        return out

    def _write(self, step: int, rows, values, total, advantages) -> None:
        path = self.exp_dir / "rollouts" / f"step_{step}{self.file_suffix}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for r, v, t, a in zip(rows, values.tolist(), total.tolist(), advantages.tolist()):
                each = {rw.name: (None if x != x else x) for rw, x in zip(self.rewards, v)}
                f.write(json.dumps({"prompt_id": r["record"].get("id"), "completion": r["text"],
                                    "completion_ids": r["ids"], "rewards": each, "reward": None if t != t else t,
                                    "advantage": a}) + "\n")  # fmt: skip


def rollout_step(cfg: TrainConfig, engine: Any, source: Any, data: Any, layout: Any) -> GroupRolloutStep:
    """The run's ``GroupRolloutStep``: the data module's template and padding; the rollouts' file written by each
    data-parallel replica's first rank (``step_N.jsonl``, ``step_N.dp<r>.jsonl`` for replica r > 0)."""
    first = engine.parallel.dims is None or all(
        getattr(engine.parallel.dims, f"{axis}_rank", 0) == 0 for axis in ("tp", "pp", "cp")
    )
    exp_dir = Path(cfg.exp_manager.exp_dir) if first else None
    step = GroupRolloutStep(cfg, engine, source.tokenizer, data.settings.template, data.collator.pad_id,
                            cfg.model.data.pad_to_multiple_of, exp_dir)  # fmt: skip
    step.file_suffix = f".dp{layout.dp_rank}" if layout.dp_rank else ""
    return step
