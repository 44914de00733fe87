"""The current benchmarks answered by the training model where its forwards are collectives over the data-parallel
ranks (FSDP2, expert parallelism): the questions shared over two replicas and decoded in lockstep (the shorter share
filled with a stand-in, every batch's forwards run by both), the answers gathered in question order; every
benchmark's scores and answer texts equal ``neva.evaluate``'s in one process on the same weights. (DDP's sharing, each
replica decoding alone, is checked by ``test_eval_during_training.py``.) One spawn of two gloo processes for both
layouts and every benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.benchmarks.lmms_cases import write_snapshots

from .harness import BASE, make_checkpoint, run_layouts

pytestmark = pytest.mark.slow

SUITES = ("mmmu", "mmstar", "ai2d", "ocrbench", "docvqa", "infovqa", "chartqa", "realworldqa", "hallusionbench",
          "mathvista", "videomme", "docvqa_test")  # fmt: skip
LIMIT, TOKENS = 3, 3  # three questions: shares of two and one (the second replica's filled with a stand-in)
MOE = "++model.mm_cfg.llm.arch_overrides={num_layers:2,num_moe_experts:4,moe_aux_loss_coeff:0.1,moe_z_loss_coeff:0.01}"


def evaluate_at_start(overrides: list[str], data: str, out: str) -> dict:
    """The configured benchmarks answered by the freshly restored training model (``model.eval``'s evaluation as
    the hook calls it), and that model saved as a checkpoint for the one-process reference."""
    import torch.distributed as dist

    from neva.checkpoint.neva_format import run_metadata
    from neva.checkpoint.source import resolve_source
    from neva.config import EvalConfig, EvalSuiteConfig, compose_config
    from neva.parallel.layout import resolve_layout
    from neva.training.eval_hook import training_state_kept
    from neva.training.export import save_final
    from neva.training.module import NevaModule
    from neva.training.run import data_module_type
    from neva.training_eval import in_training_eval

    cfg = compose_config(BASE + overrides + [f"exp_manager.exp_dir={out}"])
    suites = [EvalSuiteConfig(name, data, limit=LIMIT, batch_size=1, max_new_tokens=TOKENS) for name in SUITES]
    cfg.model.eval = EvalConfig(every_n_steps=1, suites=suites)
    evaluate = in_training_eval(cfg)
    layout, source = resolve_layout(cfg), resolve_source(cfg)
    module_data = data_module_type(cfg)(
        cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=cfg.model.micro_batch_size,
        dp_rank=layout.dp_rank, dp_world=layout.dp, seed=cfg.model.seed, accumulation=layout.grad_accum,
    )  # fmt: skip
    module_data.setup("fit")
    module = NevaModule(cfg, source, module_data, layout)
    module.configure_model()
    with training_state_kept(module.engine):
        scores = evaluate(module.engine, source.tokenizer, 0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    save_final(module.engine, source, Path(out) / "step0", is_writer=rank == 0, **run_metadata(cfg))
    return {"scores": scores}


def reference(checkpoint: Path, data: Path, out: Path, capsys) -> tuple[dict, dict]:
    """``neva.evaluate --suite <all>`` in this process: flat scores and answer texts per benchmark."""
    from neva.evaluate import main
    from neva.training_eval import flat_scores

    main(["--suite", ",".join(SUITES), "--checkpoint", str(checkpoint), "--data-dir", str(data), "--output-dir",
          str(out), "--limit", str(LIMIT), "--batch-size", "1", "--max-new-tokens", str(TOKENS)])  # fmt: skip
    torch.set_grad_enabled(True)  # evaluate turns autograd off for its process
    capsys.readouterr()
    scores, texts = {}, {}
    for result in json.loads((out / "scores.json").read_text()):
        name = result.pop("suite")
        result.pop("checkpoint")
        scores.update(flat_scores(f"eval/{name}", result))
        texts[name] = answer_texts(out / name)
    return scores, texts


def answer_texts(folder: Path) -> list[str]:
    return [json.loads(line)["text"] for line in (folder / "answers.jsonl").read_text().splitlines()]


def test_shared_questions_score_as_one_process(tmp_path, capsys):
    data = tmp_path / "data"
    write_snapshots(data)
    dense = f"model.restore_from_path={make_checkpoint(tmp_path / 'ft')}"
    moe = [f"model.restore_from_path={make_checkpoint(tmp_path / 'moe', extra=[MOE])}", MOE]
    layouts = {"fsdp": [dense, "model.data_parallel=fsdp"], "ep2": [*moe, "model.expert_model_parallel_size=2"]}
    jobs = [(name, overrides, {"data": str(data), "out": str(tmp_path / name)}) for name, overrides in layouts.items()]
    ranks = run_layouts(2, jobs, tmp_path / "dp2", train=evaluate_at_start)
    for name in layouts:
        want, texts = reference(tmp_path / name / "step0", data, tmp_path / f"reference_{name}", capsys)
        for rank in ranks:  # every rank holds the same scores: the one process's
            assert rank[name]["scores"] == want, name
        for suite in SUITES:  # rank 0 wrote the answers, in question order
            got = answer_texts(tmp_path / name / "eval" / "step=0" / suite)
            assert got == texts[suite], (name, suite)
            assert len(got) == (0 if suite == "videomme" else LIMIT)  # no video config: every question skipped
    assert any(v for k, v in want.items() if k.endswith("/questions"))
