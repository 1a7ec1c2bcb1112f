"""The shape arithmetic of bench.plan.physics, with values worked by hand, and the stand-in's saved-activation
count checked against autograd's own saved tensors."""

from __future__ import annotations

import pytest

from bench.plan.physics import (
    Arch,
    Terms,
    cache_bytes,
    layer_activation_bytes,
    logits_bytes,
    peak,
    standin_layer_bytes,
)

GLM_BASE = Arch(hidden=768, layers=12, heads=12, vocab=30592, positions=512)
GLM_10B = Arch(hidden=4096, layers=48, heads=64, vocab=50304, positions=1024)


def test_parameter_counts():
    # per block 12h^2 + 13h = 12 x 589,824 + 9,984 = 7,087,872; x 12 = 85,054,464; embeddings 30,592 x 768 +
    # 512 x 768 = 23,887,872; final LayerNorm 1,536: 108,943,872, what the glm-base records count
    assert GLM_BASE.layer_params == 7_087_872
    assert GLM_BASE.total_params == 108_943_872
    # GLM-10B with both of its position tables (1,025 x 4,096 each in the reference; 1,024 here):
    # 48 x 201,379,840 + 206,045,184 + 2 x 4,194,304 + 8,192 = 9,880,674,304
    assert Arch(4096, 48, 64, 50304, 1024, position_tables=2).total_params == 9_880_674_304
    assert GLM_BASE.largest_layer_params == 30592 * 768  # the word embedding
    # LoRA on all four block linears, 16 r h per block: GLM-10B r = 8 -> 25,165,824 (memory-and-stability 4)
    assert GLM_10B.lora_params(8) == 25_165_824


def test_korthikanti_activations():
    # s = 512, b = 1, h = 4096, a = 64: s b h (34 + 5 a s / h) = 2,097,152 x (34 + 40) = 155,189,248 B (148 MiB)
    assert layer_activation_bytes(GLM_10B, 1, 512) == 155_189_248
    # tensor parallel 8: s b h (10 + 24/8 + 5 a s / (h 8)) = 2,097,152 x (13 + 5) = 37,748,736
    assert layer_activation_bytes(GLM_10B, 1, 512, tp=8) == 37_748_736
    # full recomputation keeps the layer input only: 2 s b h = 4,194,304
    assert layer_activation_bytes(GLM_10B, 1, 512, recompute=True) == 4_194_304


def test_caches_and_logits():
    # KV: 2 x 48 x 4096 x 2 B = 786,432 B (0.75 MiB) per token; GLM's mems (48 + 1) x 4096 x 2 = 401,408
    assert cache_bytes(GLM_10B, 1, 1) == 786_432
    assert cache_bytes(GLM_10B, 1, 1, kind="mems") == 401_408
    assert cache_bytes(GLM_10B, 8, 512, tp=4) == 786_432 * 8 * 512 / 4
    # fp32 logits of one 1,024-token sequence: 1024 x 50304 x 4 = 206,045,184 B (0.19 GiB)
    assert logits_bytes(GLM_10B, 1, 1024, bytes_per_value=4) == 206_045_184
    with pytest.raises(ValueError, match="cache kind"):
        cache_bytes(GLM_10B, 1, 1, kind="paged")


def test_standin_block_by_hand():
    # per token in h-values of the compute dtype: 22 always, + 7 linear inputs when the weights train
    sbh = 2 * 256 * 768
    assert standin_layer_bytes(GLM_BASE, 2, 256, 2) == 58 * sbh
    assert standin_layer_bytes(GLM_BASE, 2, 256, 2, linear_inputs=0) == 44 * sbh
    assert standin_layer_bytes(GLM_BASE, 2, 256, 4) == 116 * sbh
    # dropout on the CPU: 25 + 2 values, fp32 Q K V (12 bytes) and 3 x 4 bytes per score, a s = 12 x 256:
    # scores per sbh = 3 x 4 x 12 x 256 / 768 = 48 -> 54 + 12 + 48 = 114 (bf16), 108 + 12 + 48 = 168 (fp32)
    assert standin_layer_bytes(GLM_BASE, 2, 256, 2, dropout=True) == 114 * sbh
    assert standin_layer_bytes(GLM_BASE, 2, 256, 4, dropout=True) == 168 * sbh
    # on CUDA the fused kernels: as without dropout plus two 1-byte masks
    assert standin_layer_bytes(GLM_BASE, 2, 256, 2, dropout=True, device="cuda") == 60 * sbh


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("frozen", [False, True])
def test_standin_block_matches_autograds_saved_tensors(dropout, frozen):
    """Autograd's saved tensors of one GPT-2 block (the difference between a 2- and a 1-block model, so the
    embeddings cancel), bf16, on this machine's torch and transformers."""
    import torch
    from transformers import GPT2Config, GPT2Model

    batch, seq = 2, 128
    arch = Arch(hidden=256, layers=1, heads=4, vocab=512, positions=256)

    def saved(layers: int) -> int:
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=arch.vocab, n_positions=arch.positions, n_embd=arch.hidden, n_layer=layers,
                            n_head=arch.heads, n_inner=4 * arch.hidden, activation_function="gelu_new",
                            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        model = GPT2Model(config).to(torch.bfloat16).train()
        if frozen:
            model.h.requires_grad_(False)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, arch.vocab, (batch, seq)))
        return sum(seen.values())

    measured = saved(2) - saved(1)
    predicted = standin_layer_bytes(arch, batch, seq, 2, dropout > 0, "cpu", 0 if frozen else 7)
    # LayerNorm statistics and the attention's log-sum-exp are left out: under 1 %
    assert measured == pytest.approx(predicted, rel=0.01)


def test_terms_add_and_peak():
    a, b = Terms(params=1, host=5), Terms(params=2, activations=3)
    assert (a + b).device == 6 and (a + b).host == 5
    assert peak(a, b) is b
