"""``model.compile``: compiled decoder blocks compute what the eager ones do (CPU inductor, tiny model)."""

import os

import pytest
import torch
import torch.nn.functional as F

from neva.config import ModelConfig
from neva.models.config import LLMConfig
from neva.models.llama import LlamaDecoder
from neva.models.media import image_media
from neva.parallel.compute_plans import apply_compute_plans, compile_enabled
from neva.typed import ConfigError, build


def test_compile_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert build(ModelConfig, {}).compile == "auto"
    assert compile_enabled("auto", cuda) and not compile_enabled("auto", cpu)
    assert compile_enabled(True, cpu) and not compile_enabled(False, cuda)
    with pytest.raises(ConfigError, match="compile must be auto, true or false"):
        build(ModelConfig, {"compile": "yes"})


SEGMENTS = torch.tensor([[1] * 10 + [2] * 14, [1] * 20 + [0] * 4])


# ``aot_eager`` always; ``inductor`` (what ``model.compile`` uses) only when asked for.
BACKENDS = [
    "aot_eager",
    pytest.param(
        "inductor",
        marks=pytest.mark.skipif(
            not os.environ.get("NEVA_TEST_INDUCTOR"),
            reason="CPU inductor compiles for minutes on 2 cores (over the CI budget); NEVA_TEST_INDUCTOR=1 runs it",
        ),
    ),
]


def _compile(root: torch.nn.Module, blocks, backend: str) -> None:
    """Compile as training does: ``model.compile`` for inductor (``apply_compute_plans``), each block otherwise."""
    if backend == "inductor":
        apply_compute_plans(root, ModelConfig(compile=True), torch.device("cpu"))
    else:
        for block in blocks:
            block.compile(backend=backend)


def _assert_eager_equal(loss_and_grads, compiled, eager) -> None:
    torch._dynamo.reset()
    loss, grads = loss_and_grads(compiled)
    ref_loss, ref_grads = loss_and_grads(eager)
    assert len(grads) == len(ref_grads) > 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_compiled_blocks_give_the_eager_loss_and_gradients(backend, packed):
    """``aot_eager`` checks what dynamo and AOT autograd capture of a block (the attention plan as an argument,
    the per-segment loop as a graph break); ``inductor`` (what ``model.compile`` uses) adds the generated kernels."""
    torch.manual_seed(0)
    cfg = LLMConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2)
    eager = LlamaDecoder(cfg)
    eager.init_weights()
    compiled = LlamaDecoder(cfg)
    compiled.load_state_dict(eager.state_dict())
    holder = torch.nn.Module()
    holder.llm = compiled
    _compile(holder, compiled.layers.values(), backend)
    ids = torch.randint(0, 64, (2, 24))
    kw = {"segment_ids": SEGMENTS} if packed else {}

    def loss_and_grads(model):
        logits = model(model.tok_embeddings(ids), **kw)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        return loss, torch.autograd.grad(loss, list(model.parameters()))

    _assert_eager_equal(loss_and_grads, compiled, eager)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_qwen2_blocks_with_lora_behind_siglip_give_the_eager_loss_and_gradients(backend):
    """The family with new parameter kinds as trained: SigLIP tower (eager) → mlp_downsample → Qwen2 blocks (q/k/v
    biases, tied embeddings) with LoRA adapters, compiled; the loss and the trainable gradients (adapters, projector)
    equal eager's."""
    import copy

    from neva.models.lora import apply_lora
    from neva.models.neva import NevaModel
    from neva.models.presets import build_config
    from neva.models.trainable import LoraSpec, TrainablePolicy, apply_policy

    torch.manual_seed(0)
    cfg = build_config("tiny_qwen2", "tiny_siglip", projector_type="mlp_downsample", num_layers=1)
    eager = NevaModel(cfg)
    eager.init_weights()
    targets = ("wq", "wk", "wv", "wo")
    apply_lora(eager, list(targets), rank=2, alpha=4.0, dropout=0.0)
    apply_policy(eager, TrainablePolicy(lora=LoraSpec(2, 4.0, 0.0, targets)))
    for name, p in eager.named_parameters():
        if "lora_b" in name.lower():  # zero at init: make the adapters change the output
            torch.nn.init.normal_(p, std=0.02)
    compiled = copy.deepcopy(eager)
    compiled.tie_weights()
    _compile(compiled, compiled.llm.layers.values(), backend)
    ids = torch.randint(0, 500, (2, 12))
    ids[:, 1 : 1 + cfg.num_image_tokens] = cfg.image_token_id
    pixels = torch.randn(2, 3, 32, 32)

    def loss_and_grads(model):
        logits = model(ids, image_media(pixels))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        trainable = [p for p in model.parameters() if p.requires_grad]
        return loss, torch.autograd.grad(loss, trainable)

    _assert_eager_equal(loss_and_grads, compiled, eager)
