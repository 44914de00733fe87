"""GRPO mode (``--grpo``): one online RL step — rollouts (sampled completions of each prompt) and the policy update —
of neva's GRPO stage against TRL's ``GRPOTrainer``, on the CPU, the same model, prompts and settings, in one run.

The model: the tiny default (the README's main job's architecture, seeded random weights) saved as a neva checkpoint
and exported to a llava-hf directory (``neva.checkpoint.hf_export``, fp32), which TRL loads with its processor and
chat template; the prompts: the built-in verifiable set (``synthetic_grpo``: a synthetic shapes image and a
question), for TRL as its conversational records with the same images. Both sides: ``--grpo-prompts`` prompts per
step, ``--grpo-generations`` completions each, at most ``--grpo-max-new`` new tokens, temperature 1, no KL term
(TRL's default), one update per rollout batch, the ``grpo`` loss (sequence means), learning rate 1e-6, one reward
function (``length_reward``: the completion's characters / 10, so groups carry advantages).

What is timed: neva, a step as the stage's ``NevaModule`` runs it (the next micro-batches from the loader, then
``GroupRolloutStep.run``: rollouts, rewards, the update, its rollouts file), with its own ``rollout_time`` /
``update_time``; TRL, ``Trainer``'s step between ``on_step_begin`` and ``on_step_end`` (its batch already fetched),
rollout = ``_generate_and_score_completions`` (the prompt's processing, generation, rewards, advantages), update =
the rest. Each side runs in its own child process and the parent alternates them step by step (``bench.cpu``'s
lockstep), so background load on a shared machine hits both alike.

TRL is not one of neva's dependencies: it runs from a side environment (``--trl-site``, default the one
``tests/training/test_grpo_trl.py`` builds: ``$NEVA_TEST_CACHE`` or ``~/.cache/neva-tests``, ``trl-1.16.0``), put in
front of this interpreter's packages (torch, transformers from the venv).
"""

from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
TRL_SITE = Path(os.environ.get("NEVA_TEST_CACHE", Path.home() / ".cache" / "neva-tests")) / "trl-1.16.0"
LR = 1e-6


def length_reward(prompt: str, completion: str, record: dict) -> float:
    """The benchmark's reward (neva's signature): the completion's characters / 10."""
    return len(completion) / 10


def trl_length_reward(completions: list, **kwargs: Any) -> list[float]:
    """The same reward in TRL's signature (a conversational completion is a list of one message)."""
    return [len(c[0]["content"] if isinstance(c, list) else c) / 10 for c in completions]


def prepare(root: Path, seed: int) -> tuple[Path, Path]:
    """The tiny default's seeded neva checkpoint and its llava-hf export under ``root``."""
    from neva.checkpoint.hf_export import export_llava
    from neva.checkpoint.neva_format import save_checkpoint
    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.models.neva import NevaModel

    source = resolve_source(compose_config(["+stage=pretrain"]))
    torch.manual_seed(seed)
    model = NevaModel(source.cfg)
    model.init_weights()
    ckpt = save_checkpoint(root / "neva", source.cfg, model.state_dict(), source.tokenizer, overwrite=True)
    export_llava(ckpt, root / "hf", dtype=torch.float32, overwrite=True, conv_template="vicuna_v1")
    return ckpt, root / "hf"


def _say(out: Any, obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _wait(word: str) -> None:
    if sys.stdin.readline().strip() != word:
        raise RuntimeError(f"lockstep protocol: expected {word!r}")


def _summary(side: str, steps: list[dict[str, float]], warmup: int) -> dict[str, Any]:
    measured = steps[warmup:]
    return {
        "side": side,
        "threads": torch.get_num_threads(),
        "steps": steps,
        **{f"median_{k}_s": statistics.median(s[k] for s in measured) for k in ("t", "cpu", "rollout", "update")},
        "completion_length": statistics.mean(s["completion_length"] for s in measured),
    }


def _neva_side(args: Any, root: Path, out: Any) -> dict[str, Any]:
    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.parallel.layout import resolve_layout
    from neva.training.module import NevaModule, StepBatches
    from neva.training.optim import build_optimizer, build_scheduler
    from neva.training.run import data_module_type

    n = args.warmup + args.steps
    cfg = compose_config([
        "+stage=grpo", f"model.restore_from_path={root / 'neva'}", f"exp_manager.exp_dir={root / 'neva-run'}",
        f"model.micro_batch_size={args.grpo_prompts}", f"model.global_batch_size={args.grpo_prompts}",
        f"model.grpo.num_generations={args.grpo_generations}", f"model.grpo.max_new_tokens={args.grpo_max_new}",
        "model.grpo.temperature=1.0", "model.grpo.rewards=[{function: 'bench.grpo:length_reward', weight: 1.0}]",
        f"model.optim.lr={LR}", f"trainer.max_steps={n}", "trainer.accelerator=cpu", f"model.seed={args.seed}",
        "model.data.num_workers=0",
        f"model.data.synthetic_train_samples={n * args.grpo_prompts}",
    ])  # fmt: skip
    layout = resolve_layout(cfg)
    source = resolve_source(cfg)
    data = data_module_type(cfg)(cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=args.grpo_prompts,
                                 dp_rank=0, dp_world=1, seed=cfg.model.seed, accumulation=layout.grad_accum)  # fmt: skip
    data.setup("fit")
    module = NevaModule(cfg, source, data, layout)
    module.configure_model()
    optimizer = build_optimizer(module.engine.named_trainable_parameters(), cfg.model.optim)
    scheduler = build_scheduler(optimizer, cfg.model.optim, n)
    batches = iter(StepBatches(data, layout.grad_accum))
    _say(out, {"ready": True})
    steps = []
    for i in range(n):
        _wait("step")
        t, c = time.perf_counter(), time.process_time()
        micro_batches = next(batches)  # the loader's work (images drawn, prompts encoded) is the step's
        module.engine.model.train()
        m = module.stage_step.run(optimizer, scheduler, micro_batches, i)
        steps.append({"t": time.perf_counter() - t, "cpu": time.process_time() - c, "loss": m["train_loss"],
                      "rollout": m["rollout_time"], "update": m["update_time"],
                      "completion_length": m["completion_length"]})  # fmt: skip
        _say(out, steps[-1])
    return _summary("neva", steps, args.warmup)


def _trl_dataset(records: list[dict[str, Any]], images: Any) -> Any:
    """TRL's conversational records with the images (built from an Arrow table with a given fingerprint: datasets
    cannot hash its default one beside the venv's pyarrow)."""
    from datasets import Dataset, DatasetInfo, Features
    from datasets import Image as ImageFeature
    from datasets.table import InMemoryTable

    def png(image: Any) -> dict[str, Any]:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return {"bytes": buf.getvalue(), "path": None}

    prompts = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["problem"]}]}]
               for r in records]  # fmt: skip
    text = {"prompt": prompts, "solution": [r["answer"] for r in records]}
    features = Features.from_arrow_schema(InMemoryTable.from_pydict(text).schema)
    features["image"] = ImageFeature()
    table = InMemoryTable.from_pydict({**text, "image": [png(images(r["image"])) for r in records]},
                                      schema=features.arrow_schema)  # fmt: skip
    return Dataset(table, info=DatasetInfo(features=features), fingerprint="neva-grpo-bench")


def _trl_side(args: Any, root: Path, out: Any) -> dict[str, Any]:
    from transformers import AutoProcessor, LlavaForConditionalGeneration, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from neva.data.synthetic import SyntheticImages
    from neva.data.synthetic_grpo import grpo_records

    n = args.warmup + args.steps
    hf = root / "hf"
    processor = AutoProcessor.from_pretrained(hf)
    model = LlavaForConditionalGeneration.from_pretrained(hf, dtype=torch.float32)
    records = grpo_records(args.seed, "train", n * args.grpo_prompts, "qa")
    dataset = _trl_dataset(records, SyntheticImages(args.seed, model.config.vision_config.image_size))
    steps: list[dict[str, float]] = []
    rollouts: list[float] = []
    lengths: list[float] = []

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            rollouts.append(time.perf_counter() - t)
            lengths.append(float(result["completion_mask"].sum(1).float().mean()))
            return result

    class Lockstep(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            _wait("step")
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            t = time.perf_counter() - self.t
            steps.append({"t": t, "cpu": time.process_time() - self.c, "loss": 0.0, "rollout": rollouts[-1],
                          "update": t - rollouts[-1], "completion_length": lengths[-1]})  # fmt: skip
            _say(out, steps[-1])

    config = GRPOConfig(
        output_dir=str(root / "trl-run"), per_device_train_batch_size=args.grpo_prompts * args.grpo_generations,
        num_generations=args.grpo_generations, max_completion_length=args.grpo_max_new, temperature=1.0,
        beta=0.0, num_iterations=1, loss_type="grpo", learning_rate=LR, lr_scheduler_type="constant",
        max_steps=n, use_cpu=True, bf16=False, fp16=False, report_to=[], logging_strategy="no", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=args.seed,
    )  # fmt: skip
    trainer = TimedGRPOTrainer(model=model, reward_funcs=[trl_length_reward], args=config, train_dataset=dataset,
                               processing_class=processor, callbacks=[Lockstep()])  # fmt: skip
    _say(out, {"ready": True})
    trainer.train()
    return _summary("trl", steps, args.warmup)


def run_side(side: str, args: Any) -> None:
    """A child: build ``side`` (``neva`` or ``trl``), run its steps in lockstep with the parent, print its summary.
    Everything else the libraries print goes to stderr: stdout carries the protocol's JSON lines only."""
    out, sys.stdout = sys.stdout, sys.stderr
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.grpo_dir)
    summary = (_neva_side if side == "neva" else _trl_side)(args, root, out)
    _wait("done")
    _say(out, summary)


def _child(side: str, args: Any, root: Path) -> list[str]:
    return [
        sys.executable, os.path.abspath(sys.argv[0]), "--grpo-child", side, "--grpo-dir", str(root),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
        "--threads", str(args.threads), "--grpo-prompts", str(args.grpo_prompts),
        "--grpo-generations", str(args.grpo_generations), "--grpo-max-new", str(args.grpo_max_new),
    ]  # fmt: skip


def trl_available(site: Path) -> bool:
    probe = [sys.executable, "-c", "import trl, datasets"]
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0


def run_grpo(args: Any) -> dict[str, Any]:
    """Run both sides, print the table; the summary (printed as JSON by the caller)."""
    from bench.cpu import _run_children

    site = Path(args.trl_site) if args.trl_site else TRL_SITE
    if not trl_available(site):
        print(f"--grpo: TRL is not importable from {site} (build its side environment with "
              "`pytest tests/training/test_grpo_trl.py`, or pass --trl-site DIR)", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    with tempfile.TemporaryDirectory(prefix="neva-grpo-bench-") as tmp:
        root = Path(tmp)
        prepare(root, args.seed)
        # the children's own search path: neva's repository, and for TRL its side environment in front
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        trl_cmd = ["env", f"PYTHONPATH={site}{os.pathsep}{os.environ['PYTHONPATH']}", *_child("trl", args, root)]
        results = _run_children([("neva", _child("neva", args, root)), ("trl", trl_cmd)], args.warmup + args.steps)
    neva, trl = results["neva"], results["trl"]
    print(f"\nGRPO step on CPU ({args.grpo_prompts} prompts x {args.grpo_generations} completions, "
          f"<= {args.grpo_max_new} new tokens, {neva['threads']} thread(s); median of {args.steps} steps after "
          f"{args.warmup} warm-up)")  # fmt: skip
    print("| side | rollout s | update s | step s | step CPU s | completion tokens | step speed-up (wall / CPU) |")
    print("|---|---|---|---|---|---|---|")
    for r in (neva, trl):
        print(f"| {r['side']} | {r['median_rollout_s']:.3f} | {r['median_update_s']:.3f} | {r['median_t_s']:.3f} | "
              f"{r['median_cpu_s']:.3f} | {r['completion_length']:.1f} | {trl['median_t_s'] / r['median_t_s']:.2f}x / "
              f"{trl['median_cpu_s'] / r['median_cpu_s']:.2f}x |")  # fmt: skip
    return {
        "mode": "grpo", "prompts": args.grpo_prompts, "generations": args.grpo_generations,
        "max_new_tokens": args.grpo_max_new, "neva": neva, "trl": trl,
        "step_speedup": trl["median_t_s"] / neva["median_t_s"],
        "step_cpu_speedup": trl["median_cpu_s"] / neva["median_cpu_s"],
        "rollout_speedup": trl["median_rollout_s"] / neva["median_rollout_s"],
        "update_speedup": trl["median_update_s"] / neva["median_update_s"],
    }  # fmt: skip
