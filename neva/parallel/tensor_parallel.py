"""Tensor (and sequence) parallel DTensor plans for NevaModel, applied from outside the model.

Megatron-style sharding: q/k/v and the SwiGLU gate/up projections column-wise (each rank owns whole heads / a slice
of the FFN width), the attention output and down projections row-wise, the token embedding and the LM head over
the vocabulary, the projector column- then row-wise (``mlp_downsample``'s LayerNorm replicated; a native tower's patch merger
likewise, its norm replicated; GLM-4.1V's merger its SwiGLU, what comes before it replicated). The vision tower stays replicated,
CLIP or SigLIP (its patch-embedding bias included: it is small and frozen in both LLaVA stages).

With sequence parallelism the residual stream between blocks holds ``S / tp`` positions per rank; the norms run on
those shards and the all-reduces of the row-wise layers become reduce-scatters. A stage's input and output stay
full-length and replicated: image features are spliced into the embeddings by position, RoPE tables and masks are
built for the whole sequence, and pipeline stages exchange whole activations.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from neva.families import part
from neva.models.config import NevaConfig
from neva.models.gated_deltanet import GatedDeltaNet
from neva.models.layers import RMSNorm
from neva.models.lora import LoRALinear
from neva.models.moe import MoEFeedForward
from neva.models.neva import NevaModel
from neva.models.projector_merger import NativeMerger
from neva.parallel.linear_attention_parallel import linear_attention_plan, sharded_dim
from neva.parallel.local_params import use_local_parameters
from neva.typed import ConfigError


def check_divisibility(cfg: NevaConfig, tp: int) -> None:
    """Heads, kv heads, FFN width and vocabulary must split evenly over ``tp`` ranks."""
    llm = cfg.llm
    checks = {
        "num_heads": llm.num_heads,
        "num_kv_heads": llm.num_kv_heads,
        "intermediate_size": llm.intermediate_size,
        "vocab_size": llm.vocab_size,
    }
    if llm.linear_attention is not None:  # each rank owns whole key heads and the value heads they serve
        checks["linear_attention.num_key_heads"] = llm.linear_attention.num_key_heads
        checks["linear_attention.num_value_heads"] = llm.linear_attention.num_value_heads
    if cfg.projector is not None and cfg.projector.type != "identity":
        checks["projector output_size (llm hidden_size)"] = cfg.projector.output_size
    bad = {k: v for k, v in checks.items() if v % tp}
    if bad:
        raise ConfigError(
            f"model.tensor_model_parallel_size={tp} does not divide the model's "
            + ", ".join(f"{k}={v}" for k, v in bad.items())
            + " (each tensor-parallel rank must own whole heads and equal vocabulary / FFN slices)"
        )


def check_tensor_parallel(model: NevaModel, tp: int) -> None:
    """What a (meta) model with its freeze policy and LoRA applied must be for ``tp`` ranks: one of the run's
    start-time rules (``run_rules.check_run``), and sharding's own precondition (``apply_tensor_parallel``).

    Raises:
        ConfigError: LoRA adapters, a trainable vision tower, or sizes ``tp`` does not divide.
    """
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ConfigError(
            "LoRA (model.peft.peft_scheme=lora) with model.tensor_model_parallel_size > 1 is not supported yet"
        )
    check_divisibility(model.cfg, tp)
    if model.vision is not None and any(p.requires_grad for p in model.vision.parameters()):
        raise ConfigError(
            "a trainable vision tower (model.mm_cfg.vision_encoder.freeze=false) with tensor parallelism is not "
            "supported yet; the tower stays replicated and frozen under TP"
        )


class NoParallel(ParallelStyle):
    """Replicated parameters as DTensors, plain tensors in and out.

    Without sequence parallelism the norms compute on replicated activations; their weights still become
    (replicated) DTensors so every trainable parameter is one, which foreach optimizers and gradient clipping need.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, (Replicate(),), run_check=False) if isinstance(x, torch.Tensor) else x
                for x in inputs
            )

        def to_local(mod, outputs, mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


class ReplicatedLocal(ParallelStyle):
    """Parameters replicated over the tensor-parallel ranks as DTensors, the module's forward on their local tensors
    and on plain activations (``local_params``): an MoE layer's router and experts, which every tensor-parallel rank
    runs on all of the layer's tokens (their gradients are then whole on each rank)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                replicated = DTensor.from_local(p.detach(), device_mesh, (Replicate(),), run_check=False)
                module.register_parameter(name, nn.Parameter(replicated, requires_grad=p.requires_grad))
        use_local_parameters(module)
        return module


def _moe_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """An MoE feed-forward under TP: router and experts replicated over tp (expert parallelism shards the experts
    over ``ep`` instead), run on the whole sequence; under SP its sequence shards are gathered before and split
    after, as the dense feed-forward's column- and row-parallel layers do."""
    plan: dict[str, ParallelStyle] = {
        "feed_forward.router": ReplicatedLocal(),
        "feed_forward.experts": ReplicatedLocal(),
    }
    if sequence_parallel:
        plan["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
        )  # fmt: skip
    return plan


def _qk_norm_plan() -> dict[str, ParallelStyle]:
    """Qwen3's q / k norms: each rank normalises its own heads (the column-parallel projections' local
    ``[B, S, heads / tp, head_dim]``), seen as a shard on the head dim (2) so the replicated weight's gradient, a
    partial sum over each rank's heads, is all-reduced as any replicated DTensor parameter's."""
    return {name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in ("q_norm", "k_norm")}


def _block_plan(sequence_parallel: bool, moe: bool = False) -> dict[str, ParallelStyle]:
    plan = _dense_block_plan(sequence_parallel)
    if moe:
        plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward")} | _moe_plan(sequence_parallel)
    return plan


def _dense_block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    if not sequence_parallel:
        return {
            "attention_norm": NoParallel(),
            "ffn_norm": NoParallel(),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
    return {
        "attention_norm": SequenceParallel(),
        # Block inputs are (x, cos, sin, mask, cache): only x is a sequence shard.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def _projector_plan(projector: nn.Module, cfg: NevaConfig) -> dict[str, ParallelStyle]:
    own = cfg.vision.spec.projector_plan if cfg.vision is not None else None
    if own is not None:  # a family's own projector class with its own plan
        return part(own)(projector)
    if isinstance(projector, NativeMerger):  # each merger: its norm replicated, fc1 column-, fc2 row-wise
        prefixes = ["merger"] + [f"deepstack.{i}" for i in range(len(projector.deepstack))]
        styles = {"norm": NoParallel, "fc1": ColwiseParallel, "fc2": RowwiseParallel}
        return {f"{p}.{name}": style() for p in prefixes for name, style in styles.items()}
    linears = [name for name, m in projector.named_children() if isinstance(m, nn.Linear)]
    # mlp_downsample's LayerNorm (gemma3's RMSNorm) runs before the first Linear, on replicated features: replicated
    # DTensor weights.
    plan: dict[str, ParallelStyle] = {
        name: NoParallel() for name, m in projector.named_children() if isinstance(m, (nn.LayerNorm, RMSNorm))
    }
    for i, name in enumerate(linears):
        if i % 2 == 0:
            last = i == len(linears) - 1
            plan[name] = ColwiseParallel(output_layouts=Replicate()) if last else ColwiseParallel()
        else:
            plan[name] = RowwiseParallel()
    return plan


def vocab_parallel_logits(tp: int, pp: int) -> bool:
    """Whether the LM head's logits stay vocab-sharded (``loss_parallel``): under TP without pipelining. A pipeline's
    last stage gathers them: torch's schedule calls the loss on plain tensors, outside the engine's loss context."""
    return tp > 1 and pp == 1


def apply_tensor_parallel(
    model: NevaModel, tp_mesh: DeviceMesh, sequence_parallel: bool, vocab_parallel_loss: bool
) -> None:
    """Shard ``model`` (a whole model or one pipeline chunk) over ``tp_mesh`` in place.

    Args:
        model: NevaModel whose absent parts (pipeline chunks) are None / deleted layers.
        tp_mesh: the 1-D tensor-parallel mesh.
        sequence_parallel: shard the residual stream over the sequence between the blocks of this chunk.
        vocab_parallel_loss: keep the logits vocab-sharded (``loss_parallel`` computes the cross-entropy on the
            shards); otherwise they are gathered.
    """
    check_tensor_parallel(model, tp_mesh.size())
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, sequence_parallel, vocab_parallel_loss))
    # Each style distributes its module's parameters on its own, which unties a shared embedding / LM head (two
    # tensors that then train apart). Both are sharded on the vocabulary (dim 0): share the embedding's again.
    model.tie_weights()


def tensor_parallel_plan(
    model: NevaModel, sequence_parallel: bool, vocab_parallel_loss: bool
) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of ``model`` (a whole model or one pipeline chunk): module name → style."""
    llm = model.llm
    plan: dict[str, ParallelStyle] = {}
    if llm.tok_embeddings is not None:
        # Replicated output: image features are spliced in by position before the sequence is split.
        plan["llm.tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.projector is not None:
        plan.update({f"projector.{k}": v for k, v in _projector_plan(model.projector, model.cfg).items()})
    if model.anyres is not None and model.anyres.image_newline is not None:
        plan["anyres"] = NoParallel()  # the newline: a replicated DTensor, the gather on replicated features
    layer_ids = list(llm.layers.keys())
    for name in layer_ids:
        moe = isinstance(llm.layers[name].feed_forward, MoEFeedForward)
        block = _block_plan(sequence_parallel, moe)
        if isinstance(llm.layers[name].attention, GatedDeltaNet):  # linear attention: its own head split
            block = {k: v for k, v in block.items() if not k.startswith("attention")} | {
                "attention_norm": block["attention_norm"],
                **linear_attention_plan(sequence_parallel),
            }
        plan.update({f"llm.layers.{name}.{k}": v for k, v in block.items()})
        if isinstance(llm.layers[name].attention, GatedDeltaNet):
            continue
        if llm.layers[name].attention.q_norm is not None:
            plan.update({f"llm.layers.{name}.attention.{k}": v for k, v in _qk_norm_plan().items()})
        if llm.layers[name].post_attention_norm is not None:  # Gemma: on the row-parallel outputs (SP: their shards)
            for norm in ("post_attention_norm", "post_ffn_norm"):
                style = SequenceParallel(use_local_output=True) if sequence_parallel else NoParallel()
                plan[f"llm.layers.{name}.{norm}"] = style
    if sequence_parallel and layer_ids:
        plan.update(_sequence_split_plan(layer_ids, model.cfg.deepstack_layers, last_stage=llm.norm is not None))
    if llm.norm is not None:
        plan["llm.norm"] = SequenceParallel() if sequence_parallel else NoParallel()
    if llm.output is not None:
        plan["llm.output"] = ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if vocab_parallel_loss else Replicate(),
            use_local_output=not vocab_parallel_loss,
        )
    return plan


def _sequence_split_plan(layer_ids: list[str], deepstack_layers: int, last_stage: bool) -> dict[str, ParallelStyle]:
    """Under SP: the first block of a chunk splits the replicated stream over the sequence, the chunk's last block
    (when no final norm follows) gathers it. Blocks take and return local shards (the residual adds mix them with the
    row-wise outputs); a block that adds DeepStack features (``add``, ``neva.models.deepstack``, built whole from the
    replicated embedding) splits them as the stream, so each rank adds its own sequence shard."""
    last = f"llm.layers.{layer_ids[-1]}"
    split_add = dict(input_kwarg_layouts={"add": Replicate()}, desired_input_kwarg_layouts={"add": Shard(1)})
    plan: dict[str, ParallelStyle] = {}
    for name in layer_ids:
        inputs: dict = {}
        if name == layer_ids[0]:
            inputs = dict(
                input_layouts=(Replicate(), None, None, None, None),
                desired_input_layouts=(Shard(1), None, None, None, None),
            )
        if int(name) < deepstack_layers:
            inputs |= split_add
        key = f"llm.layers.{name}"
        gather = key == last and not last_stage
        if gather:
            output = dict(output_layouts=Shard(1), desired_output_layouts=Replicate())
            if inputs:
                plan[key] = PrepareModuleInputOutput(**inputs, use_local_input=True, **output)
            else:
                plan[key] = PrepareModuleOutput(**output)
        elif inputs:
            plan[key] = PrepareModuleInput(**inputs, use_local_output=True)
    return plan


def tp_shard_dims(model: NevaModel) -> dict[str, int | None]:
    """The dimension tensor parallelism shards each parameter of ``model`` on (None: replicated), read off the plan
    ``apply_tensor_parallel`` applies (what the planner counts per rank).

    The styles shard as torch's do: a column-parallel Linear its weight and bias on dim 0, a row-parallel Linear its
    weight on dim 1 (bias replicated), the row-parallel (vocab-parallel) embedding its weight on dim 0; norms and
    everything outside the plan (the vision tower) stay replicated. LoRA with TP is refused today; its adapters are
    predicted as Megatron shards them: ``lora_b`` of a column-parallel layer on dim 0, ``lora_a`` of a row-parallel
    layer on dim 1, the other one replicated.
    """
    plan = tensor_parallel_plan(model, sequence_parallel=False, vocab_parallel_loss=False)
    dims: dict[str, int | None] = {}
    for name, _ in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if owner in plan:
            own = sharded_dim(plan[owner], leaf)  # a linear-attention layer's filters and decay
            dims[name] = own if own is not None else _style_dim(plan[owner], model.get_submodule(owner), leaf)
            continue
        wrapper, _, inner = owner.rpartition(".")  # a LoRALinear in the plan: ``base``, ``lora_a`` or ``lora_b``
        style = plan.get(wrapper)
        if inner == "base":
            dims[name] = _style_dim(style, model.get_submodule(owner), leaf)
        elif inner == "lora_b" and isinstance(style, ColwiseParallel):
            dims[name] = 0
        elif inner == "lora_a" and isinstance(style, RowwiseParallel):
            dims[name] = 1
        else:
            dims[name] = None
    return dims


def _style_dim(style: ParallelStyle | None, module: nn.Module, leaf: str) -> int | None:
    """Dimension ``style`` shards parameter ``leaf`` of ``module`` on (torch's Colwise/RowwiseParallel rules)."""
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return 1 if embedding else 0
    if isinstance(style, RowwiseParallel):
        return 0 if embedding else (1 if leaf == "weight" else None)
    return None  # NoParallel / SequenceParallel keep parameters replicated
