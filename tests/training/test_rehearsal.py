"""The full-size rehearsal (``neva.training.rehearsal``): fake tensors count what real ones allocate, byte for byte;
a layout the code cannot run fails; every shipped preset's layout runs its real step (at full width, shallow depth,
pipeline stages included)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed._tools.mem_tracker import MemTracker

import neva
from neva.checkpoint.architecture import neva_config_from_mm
from neva.config import compose_config
from neva.parallel.layout import Layout
from neva.plan import main, rehearse_against_plan
from neva.planner.plan import plan_run, text_tokens_of
from neva.training.rehearsal import CATEGORIES, RehearsalUnavailable, edge_stages, rehearse, require, shallow
from neva.typed import ConfigError

PRESETS = sorted(p.stem for p in (Path(neva.__file__).parent / "configs" / "preset").glob("*.yaml"))

TINY_O2 = ["+stage=finetune", "trainer.precision=bf16", "model.megatron_amp_O2=true", "model.micro_batch_size=1"]


@pytest.mark.parametrize(
    "overrides",
    [
        # TP 2 × FSDP2 ZeRO-3 over 2 (O2, full activation checkpointing, clipping): DTensors, gathers, recomputation.
        ["trainer.devices=4", "model.tensor_model_parallel_size=2", "model.global_batch_size=4",
         "model.activations_checkpoint_granularity=full", "trainer.gradient_clip_val=1.0"],
        # One process, O2: bf16 parameters, fp32 masters, the flat main-grad buffer.
        ["trainer.devices=1", "model.global_batch_size=2"],
        # Two 1F1B pipeline stages × TP 2 with sequence parallelism × FSDP2 over 2 (O2): static stage shapes, the
        # warm-up's in-flight micro-batches, the receive buffers; the first stage holds vision and embeddings, the
        # last the head; sequence-sharded norms between the TP regions of each stage.
        ["trainer.devices=8", "model.pipeline_model_parallel_size=2", "model.tensor_model_parallel_size=2",
         "model.sequence_parallel=true", "model.global_batch_size=6"],
        # Context parallelism 2 × two 1F1B stages (O2, FSDP2 over dp × cp): the micro-batches split on the host before
        # fake mode, the stages' shapes the shares', the keys' and values' all-gathers.
        ["trainer.devices=4", "model.pipeline_model_parallel_size=2", "model.context_parallel_size=2",
         "model.global_batch_size=2", "model.loss_normalization=global_tokens"],
    ],
    ids=["tp2_fsdp2_o2_ac", "one_process_o2", "pp2_tp2_sp_fsdp2_o2", "cp2_pp2_fsdp2_o2"],
)  # fmt: skip
def test_fake_step_allocates_what_the_real_step_allocates(overrides: list[str]) -> None:
    """Byte for byte, with one decoder layer per pipeline chunk (the tracker's cost is per operation)."""
    cfg = compose_config(TINY_O2 + overrides)
    layout = Layout.from_config(cfg.model, cfg.trainer.devices)
    model = shallow(neva_config_from_mm(cfg.model.mm_cfg), layout)
    fake = rehearse(cfg, text_tokens=16, model=model)
    real = rehearse(cfg, text_tokens=16, model=model, fake=False)
    assert [(r.peak, r.categories, r.where) for r in fake] == [(r.peak, r.categories, r.where) for r in real]
    assert [r.stage for r in fake] == list(range(cfg.model.pipeline_model_parallel_size))
    assert all(r.peak == sum(r.categories.values()) > 0 for r in fake)
    assert all(set(r.categories) == set(CATEGORIES) for r in fake)


def test_interleaved_chunks_rehearse() -> None:
    """Two interleaved chunks per rank (virtual pipeline stages; O2 under FSDP2 at dp 1), the first stage (chunks 0
    and 2: vision, embeddings and a middle chunk): the multi-stage schedule's set-up decided locally, and a later
    chunk's forwards of two micro-batches between the first chunk's. (Fake equals real byte for byte on both stages
    too, which costs 4 runs: checked by hand, docs/PLANNER.md.)"""
    cfg = compose_config(TINY_O2 + ["trainer.devices=2", "model.pipeline_model_parallel_size=2",
                                    "model.virtual_pipeline_model_parallel_size=2", "model.global_batch_size=4"])  # fmt: skip
    layout = Layout.from_config(cfg.model, cfg.trainer.devices)
    model = shallow(neva_config_from_mm(cfg.model.mm_cfg), layout)
    (measured,) = rehearse(cfg, text_tokens=16, model=model, stages=[0])
    assert measured.peak == sum(measured.categories.values()) > 0
    assert measured.categories["optimizer"] > 0 and measured.categories["activations"] > 0


def test_planned_state_equals_the_rehearsed_one() -> None:
    """O2 under TP 2 × FSDP2: the planner's parameter and AdamW bytes are the rehearsal's, exactly (frozen vision
    shards included, which FSDP2 keeps in fp32)."""
    overrides = [
        "trainer.devices=4",
        "model.tensor_model_parallel_size=2",
        "model.global_batch_size=2",
        "cluster=dgx_a100",
    ]
    cfg = compose_config(TINY_O2 + overrides)
    (measured,) = rehearse(cfg, text_tokens=16)
    planned = plan_run(cfg, text_tokens=16).stages[0]
    assert (measured.categories["params"], measured.categories["optimizer"]) == (planned.params, planned.optimizer)


def test_a_layout_that_cannot_run_fails_the_rehearsal() -> None:
    heads = neva_config_from_mm(compose_config(["+stage=finetune"]).model.mm_cfg).llm.num_heads
    tp = next(t for t in range(2, 2 * heads) if heads % t)
    cfg = compose_config(["+stage=finetune", f"trainer.devices={tp}", f"model.tensor_model_parallel_size={tp}"])
    with pytest.raises(ConfigError, match="head"):
        rehearse(cfg, text_tokens=16)


def test_the_canary_rehearses(capsys: pytest.CaptureFixture[str]) -> None:
    """The canary's one GPU (``cluster=local``, ``trainer.devices=auto``), packed rows and ``model.data.seq_length``
    left to the model each used to stop ``plan.rehearse=true`` (a division by the absent link's bandwidth, a refused
    device count, a ``None`` row capacity, segment values read on fake tensors)."""
    overrides = ["+canary=pretrain", "cluster.peak_tflops_bf16=100", "model.global_batch_size=2",
                 "model.micro_batch_size=2", "plan.rehearse=true"]  # fmt: skip
    cfg = compose_config(overrides[:-1])
    assert cfg.model.data.packing and cfg.model.data.seq_length is None and cfg.trainer.devices == "auto"
    main(overrides)
    assert any(" rehearsed " in line for line in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_layout_runs_its_step(preset: str) -> None:
    """Every width, sequence length, micro-batch size, precision and plan of the preset, with one decoder layer per
    pipeline chunk and two vision layers (the full depth is the command line's ``plan.rehearse=true``). Without
    pipelining one micro-batch (forward, backward, reduction, clipping, AdamW; a second would repeat its shapes);
    pipelined, the first and the last stage with ``pp + 1`` micro-batches per step, so that every stage reaches
    1F1B's steady phase (backward, then forward with gradients held)."""
    cfg = compose_config([f"+preset={preset}"])
    layout = Layout.from_config(cfg.model, cfg.trainer.devices * cfg.trainer.num_nodes)
    if layout.pp > 1:
        gbs = layout.micro_batch_size * layout.dp * (layout.pp + 1)
        cfg = compose_config([f"+preset={preset}", f"model.global_batch_size={gbs}"])
    model = shallow(neva_config_from_mm(cfg.model.mm_cfg), layout)
    stages = edge_stages(layout)
    measured = rehearse(cfg, text_tokens_of(cfg), model=model, micro_batches=1, stages=stages)
    assert [r.stage for r in measured] == stages
    assert all(r.peak == sum(r.categories.values()) > 0 for r in measured)


TINY_PLAN = ["+stage=finetune", "cluster=dgx_a100", "trainer.devices=2", "model.global_batch_size=2",
             "model.micro_batch_size=1", "plan.rehearse=true"]  # fmt: skip


def test_plan_rehearse_prints_the_measured_peak_beside_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    main(TINY_PLAN)
    out = capsys.readouterr().out
    assert "# rehearsal: one real optimizer step per rank role" in out
    rehearsed = next(line for line in out.splitlines() if " rehearsed " in line)
    assert "micro-batch" in rehearsed  # where the peak fell
    assert any(line.lstrip().startswith("planned") for line in out.splitlines())


def test_plan_rehearse_of_a_context_parallel_layout_says_what_the_cpu_path_adds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(TINY_PLAN + ["trainer.devices=4", "model.context_parallel_size=2"])
    out = capsys.readouterr().out
    assert any(" rehearsed " in line for line in out.splitlines())
    assert "# context parallelism: cp rank 0 rehearsed; its activ includes a [S/4, S] causal mask" in out


def test_plan_rehearse_exits_non_zero_when_the_real_path_fails(capsys: pytest.CaptureFixture[str]) -> None:
    """LoRA under TP: training refuses it at start, and so does the planner now (one list of start-time rules,
    ``neva.parallel.run_rules.check_run``), before any rehearsal; the pre-flight's own exit (status 1 and the
    error) is that of a real path that fails, here the same refusal reached by the rehearsal itself."""
    tp, lora = ["model.tensor_model_parallel_size=2"], ["model.peft.peft_scheme=lora"]
    with pytest.raises(ConfigError, match="LoRA"):
        main(TINY_PLAN + tp + lora)
    overrides = [arg for arg in TINY_PLAN if not arg.startswith("plan.")] + tp
    cfg = compose_config(overrides + lora)
    plan = plan_run(compose_config(overrides))  # the same layout without LoRA, which the planner plans
    with pytest.raises(SystemExit) as exit_info:
        rehearse_against_plan(cfg, plan, None)
    assert exit_info.value.code == 1
    assert "rehearsal failed: ConfigError: LoRA" in capsys.readouterr().err


def test_plan_rehearse_exits_2_on_a_torch_without_a_private_api_it_uses() -> None:
    """A fresh interpreter in which one private module the rehearsal imports cannot be imported (``sys.modules[name]
    = None`` is Python's own way to make an import fail; torch itself is not changed): the pre-flight says so in one
    line and exits 2."""
    blocked = "torch.distributed._tools.fsdp2_mem_tracker"
    code = f"import sys; sys.modules[{blocked!r}] = None; from neva.plan import main; main({TINY_PLAN!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("rehearsal")]
    assert line.startswith("rehearsal unavailable: torch ") and blocked in line


def test_a_private_member_that_differs_makes_the_rehearsal_unavailable() -> None:
    """The members checked beside the imports (a renamed attribute of torch's tracker, say) answer the same way."""
    require(MemTracker, "reset_mod_stats")
    with pytest.raises(RehearsalUnavailable, match="MemTracker has no reset_mod_statistics, which the rehearsal"):
        require(MemTracker, "reset_mod_statistics")


@pytest.mark.parametrize(
    "overrides",
    [["trainer.devices=1"], ["trainer.devices=2"], ["trainer.devices=1", "model.dpo.precompute_ref_log_probs=true"]],
    ids=["frozen_reference", "dp2_zero3_frozen_reference", "precomputed"],
)
def test_the_dpo_step_rehearses_pairs_and_its_reference_as_planned(overrides: list[str]) -> None:
    """A preference stage's rehearsal steps on pairs (two rows a pair) with its reference's forward and weights (a
    frozen copy; none when precomputed): its peak is the planner's (``neva.planner.preference``) within 10 %, its
    parameters (the reference's shards too) exactly, and it exceeds finetuning's on the same samples."""
    base = ["cluster=dgx_a100", "model.micro_batch_size=2", "model.global_batch_size=4", *overrides]
    cfg = compose_config(["+stage=dpo", *base])
    (measured,) = rehearse(cfg, text_tokens=64)
    planned = plan_run(cfg, text_tokens=64).stages[0]
    total = planned.params + planned.grads + planned.optimizer + planned.activations + planned.working
    total += planned.reference
    assert abs(measured.peak - total) <= 0.1 * measured.peak, (measured, planned)
    if cfg.trainer.devices == 1:
        assert measured.categories["params"] == planned.params + planned.reference
    else:  # FSDPMemTracker follows its root's parameters: the reference's shards are counted under "other"
        assert measured.categories["params"] == planned.params
        assert measured.categories["other"] >= planned.reference > 0
    (finetune,) = rehearse(compose_config(["+stage=finetune", *base]), text_tokens=64)
    assert measured.categories["activations"] > finetune.categories["activations"]


# Context parallelism at a reduced but telling size: Llama-2-7B's shape of layer (multi-head attention, head_dim 64,
# the 11/4 MLP ratio) at width 1024 and depth 8, one 4112-token row (16 image positions, 4096 text tokens) per step and
# rank, on 4 ranks (dp = 4 / cp: one micro-batch per rank at every cp).
CP_WIDTH, CP_LAYERS, CP_TEXT = 1024, 8, 4096


def _cp_step(cp: int) -> tuple:
    cfg = compose_config(TINY_O2 + ["cluster=dgx_a100", "trainer.devices=4", f"model.global_batch_size={4 // cp}",
                                    f"model.context_parallel_size={cp}", f"model.data.seq_length={CP_TEXT + 64}"])  # fmt: skip
    ncfg = neva_config_from_mm(cfg.model.mm_cfg)
    llm = dataclasses.replace(ncfg.llm, hidden_size=CP_WIDTH, num_heads=CP_WIDTH // 64, num_kv_heads=CP_WIDTH // 64,
                              head_dim=64, intermediate_size=CP_WIDTH * 11 // 4, num_layers=CP_LAYERS,
                              max_seq_len=CP_TEXT + 64)  # fmt: skip
    model = dataclasses.replace(ncfg, llm=llm, projector=dataclasses.replace(ncfg.projector, output_size=CP_WIDTH))
    (measured,) = rehearse(cfg, text_tokens=CP_TEXT, model=model)
    return measured, plan_run(cfg, text_tokens=CP_TEXT, model=model)


def test_context_parallel_rehearses_a_share_of_the_activations_and_the_gathered_keys_and_values() -> None:
    """The real CP step on fake tensors (cp rank 0, the micro-batch split on the host before fake mode): per rank its
    activations are at most CP 1's / cp plus the attention working set, computed here, and the planner's activations
    are within ±10 % of it at CP 1, 2 and 4.

    The attention working set of a rank, per layer: the whole row's keys and values, all-gathered and kept for
    backward (``2 · S · kv_heads · head_dim`` bf16), and, on the CPU path the rehearsal runs (CUDA takes FlexAttention
    instead), the mask of every local chunk whose queries see more keys than themselves: the per-segment SDPA of a
    chunk of ``c = S / 2cp`` queries against the ``k`` keys up to its end keeps its ``[c, k]`` mask in bf16 for
    backward. cp rank 0's chunks end at ``c`` (no mask: top-left causal) and at ``S``: ``c · S`` per layer."""
    steps = {cp: _cp_step(cp) for cp in (1, 2, 4)}
    e, kv_width = 2, CP_WIDTH  # bf16; MHA: kv_heads · head_dim = hidden
    cpu_masks, gathered = {}, {}
    for cp, (measured, planned) in steps.items():
        length = -(-planned.seq_len // (2 * cp)) * 2 * cp  # the row as the split pads it
        chunk = length // (2 * cp)
        cpu_masks[cp] = CP_LAYERS * chunk * length * e if cp > 1 else 0
        gathered[cp] = CP_LAYERS * 2 * length * kv_width * e if cp > 1 else 0
        assert measured.stage == 0 and measured.rank == 0 and measured.peak == sum(measured.categories.values())
    act = {cp: measured.categories["activations"] for cp, (measured, _) in steps.items()}
    for cp in (2, 4):
        assert act[cp] <= act[1] / cp + gathered[cp] + cpu_masks[cp]
        # the gathered keys and values are in the peak (a share of CP 1 alone falls short by half of them)
        assert act[cp] >= act[1] / cp + gathered[cp] / 2
    # The planner's activations (CUDA kernels: no masks) against the rehearsal's less the CPU masks. The tracker files
    # a layer's backward buffers under temporaries: compared whole with gradients, as docs/PERFORMANCE.md does.
    for cp, (measured, planned) in steps.items():
        c = measured.categories
        rehearsed = c["grads"] + c["activations"] + c["temporaries"] - cpu_masks[cp]
        stage = planned.stages[0]
        assert stage.grads + stage.activations == pytest.approx(rehearsed, rel=0.10), cp
