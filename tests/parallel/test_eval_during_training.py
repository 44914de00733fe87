"""Evaluation during training (``model.eval``): the training model answers POPE (tiny official-layout files, as
``tests/benchmarks`` builds them) at step 2 of 3 under one process (LoRA with adapter dropout: train mode must come
back), DP2 with FSDP2 (each replica answers half, in lockstep: each forward gathers the shards), DP2 with DDP (each
replica answers half, gathered), PP2 (greedy decoding through the stages, a KV cache per stage) and TP2 (each rank
caching its own heads, the vocabulary-sharded logits gathered). Each run's scores
equal those of ``neva.evaluate`` on the checkpoint consolidated at that step, and its losses (step 3 included) equal
the same layout's without evaluation, bit for bit. One spawn of two gloo processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.benchmarks.conftest import write_jsonl
from tests.benchmarks.test_pope import make_pope

from .harness import BASE, make_checkpoint, run_layouts

pytestmark = pytest.mark.slow

STEPS, EVERY = 3, 2
TOKENS = 6  # new tokens per answer (LLaVA's 128 for POPE would only make the test slower)
# a learning rate that keeps the tiny model near its random start, whose answers are words (a few steps at BASE's
# rate teach it to end every reply at once: empty answers that any two runs would share)
SLOW = ["model.optim.lr=1e-5"]
SKILLS = 6  # questions of the synthetic skills suite (answers under three feeds, and teacher-forced reply losses)
LAYOUTS = {
    "fsdp": ["model.data_parallel=fsdp"],
    "ddp": ["model.data_parallel=ddp"],
    "pp2": ["model.pipeline_model_parallel_size=2"],
    "tp2": ["model.tensor_model_parallel_size=2"],
    "tp2sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
}


def train_with_eval(overrides: list[str], data: str, out: str, with_eval: bool) -> dict:
    """``STEPS`` optimizer steps as ``NevaModule.training_step`` takes them, and (``with_eval``) the benchmarks
    after every ``EVERY``-th as ``EvalDuringTraining`` runs them, with that step's consolidated checkpoint."""
    import torch.distributed as dist

    from neva.checkpoint.neva_format import run_metadata
    from neva.checkpoint.source import resolve_source
    from neva.config import EvalConfig, EvalSuiteConfig, compose_config
    from neva.parallel.layout import resolve_layout
    from neva.training.eval_hook import training_state_kept
    from neva.training.export import save_final
    from neva.training.module import NevaModule, StepBatches
    from neva.training.optim import build_optimizer, build_scheduler
    from neva.training.run import data_module_type
    from neva.training_eval import in_training_eval

    cfg = compose_config(BASE + overrides + [f"exp_manager.exp_dir={out}"])
    suites = [EvalSuiteConfig("pope", data, limit=4, batch_size=1, max_new_tokens=TOKENS),
              EvalSuiteConfig("skills", limit=SKILLS, batch_size=SKILLS, max_new_tokens=TOKENS)]  # fmt: skip
    cfg.model.eval = EvalConfig(every_n_steps=EVERY, suites=suites)
    evaluate = in_training_eval(cfg) if with_eval else None
    layout, source = resolve_layout(cfg), resolve_source(cfg)
    module_data = data_module_type(cfg)(
        cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=cfg.model.micro_batch_size,
        dp_rank=layout.dp_rank, dp_world=layout.dp, seed=cfg.model.seed, accumulation=layout.grad_accum,
    )  # fmt: skip
    module_data.setup("fit")
    module = NevaModule(cfg, source, module_data, layout)
    module.configure_model()
    engine = module.engine
    optimizer = build_optimizer(engine.named_trainable_parameters(), cfg.model.optim)
    scheduler = build_scheduler(optimizer, cfg.model.optim, cfg.trainer.max_steps)
    losses, scores = [], {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    for i, micro_batches in enumerate(StepBatches(module_data, layout.grad_accum)):
        if i == STEPS:
            break
        engine.model.train()
        loss, *_ = engine.optimizer_step(optimizer, micro_batches, cfg.trainer.gradient_clip_val, step=i)
        scheduler.step()
        losses.append(loss.item())
        step = i + 1
        if evaluate is not None and step % EVERY == 0:
            with training_state_kept(engine):
                scores[step] = evaluate(engine, source.tokenizer, step)
                probe = probe_logits(engine, source.tokenizer, run_metadata(cfg), data)
            save_final(engine, source, Path(out) / f"step{step}", is_writer=rank == 0, **run_metadata(cfg))
    return {"losses": losses, "scores": scores, **({"probe": probe} if evaluate is not None else {})}


def probe_question(data: str) -> tuple[str, list[Path]]:
    question = json.loads((Path(data) / "pope" / "llava_pope_test.jsonl").read_text().splitlines()[0])
    return question["text"], [Path(data) / "pope" / "val2014" / question["image"]]


def probe_logits(engine, tokenizer, meta: dict, data: str) -> list[float]:
    """The next-token logits of the first POPE question's prompt, from the training model as generation runs it."""
    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig
    from neva.models.media import image_media
    from neva.parallel.generation_model import LayoutGenerationModel

    model = LayoutGenerationModel(engine.parallel, engine.autocast)
    prepared = Answerer.for_model(model, tokenizer, meta, GenerationConfig()).prepare(probe_question(data))
    ids, pixels = prepared[0], prepared[1]
    logits = model(torch.tensor([ids]), image_media(pixels, torch.tensor([1])))
    model.finish()
    return logits[0, -1].tolist()


def reference_logits(checkpoint: Path, data: Path) -> torch.Tensor:
    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig
    from neva.models.media import image_media

    answerer = Answerer(checkpoint, GenerationConfig(), dtype=torch.float32)
    prepared = answerer.prepare(probe_question(str(data)))
    ids, pixels = prepared[0], prepared[1]
    with torch.no_grad():
        return answerer.model(torch.tensor([ids]), image_media(pixels, torch.tensor([1])))[0, -1]


def reference_scores(checkpoint: Path, data: Path, out: Path, capsys) -> dict:
    """``neva.evaluate --suite pope`` and ``--suite skills`` on ``checkpoint``, as ``train_with_eval``'s suites ask
    them."""
    from neva.evaluate import main
    from neva.training_eval import flat_scores

    capsys.readouterr()
    main(["--suite", "pope", "--checkpoint", str(checkpoint), "--data-dir", str(data), "--output-dir", str(out),
          "--limit", "4", "--batch-size", "1", "--max-new-tokens", str(TOKENS)])  # fmt: skip
    main(["--suite", "skills", "--checkpoint", str(checkpoint), "--limit", str(SKILLS), "--batch-size", str(SKILLS),
          "--max-new-tokens", str(TOKENS)])  # fmt: skip
    torch.set_grad_enabled(True)  # evaluate turns autograd off for its process
    skills = json.loads(capsys.readouterr().out.splitlines()[-1])
    del skills["checkpoint"]
    return {**flat_scores("eval/pope", json.loads((out / "scores.json").read_text())),
            **flat_scores("eval/skills", skills)}  # fmt: skip


def pope_files(root: Path) -> Path:
    make_pope(root)
    # a fifth question beyond the suite's limit, whose image is absent: the limit leaves it unread
    lines = (root / "pope" / "llava_pope_test.jsonl").read_text().splitlines()
    extra = {"question_id": 999, "image": "absent.jpg", "text": "Is there a cat?", "category": "random"}
    write_jsonl(root / "pope" / "llava_pope_test.jsonl", [json.loads(x) for x in lines[:4]] + [extra])
    return root


def check(result: dict, without: dict, data: Path, out: Path, capsys) -> None:
    assert result["losses"] == without["losses"]  # bit-identical: evaluation changed nothing the next step sees
    assert list(result["scores"]) == [EVERY]
    got = result["scores"][EVERY]
    want = reference_scores(out / f"step{EVERY}", data, out / "reference", capsys)
    assert got.keys() == want.keys()
    assert {k: v for k, v in got.items() if "/pope/" in k} == {k: v for k, v in want.items() if "/pope/" in k}
    # the skills' reply probabilities are rounded to 4 places: a layout's last-digit rounding may cross one
    for key, value in want.items():
        assert abs(got[key] - value) <= (1e-4 if "reply_prob" in key else 0), (key, got[key], value)
    assert got["eval/pope/questions"] == 4 and "eval/pope/mean_accuracy" in got
    # (a near-random model's reply probabilities round to 0 here: the skills suite checks that its teacher-forced
    # forward runs through each layout and that its answers and accuracies are the checkpoint's)
    assert got["eval/skills/n"] == SKILLS and any(k.startswith("eval/skills/skills/") for k in got)
    # the same answers, word for word (rank 0 wrote the run's): the scores of a random model say little alone
    texts = [[json.loads(line)["text"] for line in path.read_text().splitlines()]
             for path in (out / "eval" / f"step={EVERY}" / "pope" / "answers.jsonl", out / "reference" / "answers.jsonl")]  # fmt: skip
    assert texts[0] == texts[1] and len(texts[0]) == 4 and all(texts[0])
    # and the logits generation starts from, to rounding (a layout sums in another order than one process)
    probe = torch.tensor(result["probe"])
    reference = reference_logits(out / f"step{EVERY}", data)
    torch.testing.assert_close(probe, reference, rtol=1e-4, atol=1e-5)


def test_eval_during_training_matches_evaluate(tmp_path, capsys):
    data = pope_files(tmp_path / "data")
    restore = [f"model.restore_from_path={make_checkpoint(tmp_path / 'ft')}", *SLOW]
    lora = ["model.peft.peft_scheme=lora", "model.peft.lora_tuning.adapter_dropout=0.1"]
    one = {k: train_with_eval(restore + lora, **{"data": str(data), "out": str(tmp_path / f"one_{k}"), "with_eval": k})
           for k in (True, False)}  # fmt: skip
    check(one[True], one[False], data, tmp_path / "one_True", capsys)
    jobs = [
        (f"{name}_{k}", restore + overrides, {"data": str(data), "out": str(tmp_path / f"{name}_{k}"), "with_eval": k})
        for name, overrides in LAYOUTS.items()
        for k in (True, False)
    ]
    ranks = run_layouts(2, jobs, tmp_path / "dp2", train=train_with_eval)
    for name in LAYOUTS:
        for rank in ranks:  # every rank holds the same scores
            result = {**rank[f"{name}_True"], "scores": {int(k): v for k, v in rank[f"{name}_True"]["scores"].items()}}
            check(result, rank[f"{name}_False"], data, tmp_path / f"{name}_True", capsys)
