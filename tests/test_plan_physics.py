"""The shape arithmetic of bench.plan.physics, with values worked by hand, and each family's saved-activation
count checked against autograd's own saved tensors."""

from __future__ import annotations

import pytest

from bench.plan.physics import (
    Arch,
    Terms,
    cache_bytes,
    layer_activation_bytes,
    layer_saved_bytes,
    logits_bytes,
    peak,
)
from bench.run.families import MEANINGS

GLM_BASE = Arch(hidden=768, layers=12, heads=12, vocab=30592, positions=512)
GLM_10B = Arch(hidden=4096, layers=48, heads=64, vocab=50304, positions=1024)
LLAMA3_8B = Arch(hidden=4096, layers=32, heads=32, vocab=128256, positions=8192, family="llama", kv_heads=8,
                 intermediate=14336)
GLM4_9B = Arch(hidden=4096, layers=40, heads=32, vocab=151552, positions=8192, family="glm", kv_heads=2,
               intermediate=13696)


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


def test_llama_and_glm4_parameter_counts_by_hand():
    # Llama-3-8B, per block: q and o 4096^2 = 16,777,216 each, k and v 4096 x 1024 (8 K/V heads of 128) =
    # 4,194,304 each, SwiGLU 3 x 4096 x 14336 = 176,160,768, two RMSNorms 8,192: 218,112,000; x 32 =
    # 6,979,584,000; embedding and untied head 2 x 128,256 x 4096 = 1,050,673,152; final norm 4,096:
    # 8,030,261,248 (Meta's published 8.03 B)
    assert LLAMA3_8B.layer_params == 218_112_000
    assert LLAMA3_8B.head_params == LLAMA3_8B.vocab * 4096 == 525_336_576
    assert LLAMA3_8B.total_params == 8_030_261_248
    assert LLAMA3_8B.backbone_params == 8_030_261_248 - 525_336_576  # a critic carries no LM head
    # GLM-4-9B, per block: q 16,777,216 + 4,096 bias, k and v 4096 x 256 (2 K/V heads) + 256 bias each, o
    # 16,777,216, gate_up 4096 x 27,392 = 112,197,632, down 13,696 x 4096 = 56,098,816, norms 8,192:
    # 203,960,832; x 40 = 8,158,433,280; + 2 x 151,552 x 4096 + 4,096 = 9,399,951,360 (9.4 B)
    assert GLM4_9B.layer_params == 203_960_832
    assert GLM4_9B.total_params == 9_399_951_360
    assert GLM4_9B.largest_layer_params == 151552 * 4096  # the embedding beats the fused gate_up (112 M)
    # tied GPT-2: the head is the embedding, so backbone and LM count alike
    assert GLM_BASE.head_params == 0 and GLM_BASE.backbone_params == GLM_BASE.total_params


def test_lora_and_linear_inputs_by_meaning():
    # Llama-3-8B, r = 8 on all seven maps: q, o r(4096 + 4096) = 65,536 each; k, v r(4096 + 1024) = 40,960 each;
    # gate, up, down r(4096 + 14336) = 147,456 each: 655,360 per block, x 32 = 20,971,520
    assert LLAMA3_8B.lora_params(8) == 20_971_520
    assert LLAMA3_8B.lora_params(8, ("q", "v")) == 32 * (65_536 + 40_960)  # peft's Llama default
    # GLM-4's fused gate_up is one module: r(4096 + 27,392) = 251,904 a block, not 2 x r(4096 + 13,696)
    assert GLM4_9B.lora_params(8, ("gate", "up")) == 40 * 251_904
    # GPT-2's fused c_attn: q, k, v as one module r(h + 3h)
    assert GLM_BASE.lora_params(8, ("q", "k", "v")) == 12 * 8 * 4 * 768
    # saved inputs per token in h-values: q/k/v share one, o one, gate/up share one, down i/h
    assert GLM_BASE.linear_inputs() == 7 and GLM_BASE.linear_inputs(("q", "k", "v", "down")) == 5
    assert LLAMA3_8B.linear_inputs() == 3 + 14336 / 4096
    assert LLAMA3_8B.block_weights(("k", "v")) == 32 * 2 * 4096 * 1024
    assert LLAMA3_8B.block_rows() == 32 * (4096 + 2 * 1024 + 4096 + 3 * 14336 - 14336 + 4096)


def test_korthikanti_activations():
    # s = 512, b = 1, h = 4096, a = 64: s b h (34 + 5 a s / h) = 2,097,152 x (34 + 40) = 155,189,248 B (148 MiB)
    assert layer_activation_bytes(GLM_10B, 1, 512) == 155_189_248
    # tensor parallel 8: s b h (10 + 24/8 + 5 a s / (h 8)) = 2,097,152 x (13 + 5) = 37,748,736
    assert layer_activation_bytes(GLM_10B, 1, 512, tp=8) == 37_748_736
    # full recomputation keeps the layer input only: 2 s b h = 4,194,304
    assert layer_activation_bytes(GLM_10B, 1, 512, recompute=True) == 4_194_304
    # frozen under a trained layer: no inputs for weight gradients. GPT-2: 10 - 4 outside, 8 - 2 + 16 - 8 inside,
    # the scores 5as/h = 40: 60 sbh; Llama-3-8B (kv 1,024, i = 3.5h, as/h = 4): 8 - 4 outside, 4 + 1 + 28 - 2 - 7
    # inside, the softmax 8: 36 sbh (49 trained)
    sbh = 512 * 4096
    assert layer_activation_bytes(GLM_10B, 1, 512, frozen=True) == 60 * sbh == 125_829_120
    assert layer_activation_bytes(LLAMA3_8B, 1, 512) == 49 * sbh
    assert layer_activation_bytes(LLAMA3_8B, 1, 512, frozen=True) == 36 * sbh


def test_caches_and_logits():
    # KV: 2 x 48 x 4096 x 2 B = 786,432 B (0.75 MiB) per token; GLM's mems (48 + 1) x 4096 x 2 = 401,408
    assert cache_bytes(GLM_10B, 1, 1) == 786_432
    assert cache_bytes(GLM_10B, 1, 1, kind="mems") == 401_408
    assert cache_bytes(GLM_10B, 8, 512, tp=4) == 786_432 * 8 * 512 / 4
    # fp32 logits of one 1,024-token sequence: 1024 x 50304 x 4 = 206,045,184 B (0.19 GiB)
    assert logits_bytes(GLM_10B, 1, 1024, bytes_per_value=4) == 206_045_184
    with pytest.raises(ValueError, match="cache kind"):
        cache_bytes(GLM_10B, 1, 1, kind="paged")
    # grouped-query attention caches K and V at kv_heads: Llama-3-8B 2 x 32 x 1024 x 2 B = 131,072 B a token
    # (a quarter of multi-head attention's 524,288); GLM-4-9B 2 x 40 x 256 x 2 = 40,960
    assert cache_bytes(LLAMA3_8B, 1, 1) == 131_072
    assert cache_bytes(GLM4_9B, 1, 1) == 40_960


def test_standin_block_by_hand():
    # per token in h-values of the compute dtype: 22 always, + 7 linear inputs when the weights train
    sbh = 2 * 256 * 768
    assert layer_saved_bytes(GLM_BASE, 2, 256, 2) == 58 * sbh
    assert layer_saved_bytes(GLM_BASE, 2, 256, 2, linear_inputs=0) == 44 * sbh
    assert layer_saved_bytes(GLM_BASE, 2, 256, 4) == 116 * sbh
    # dropout on the CPU: 25 + 2 values, fp32 Q K V (12 bytes) and 3 x 4 bytes per score, a s = 12 x 256:
    # scores per sbh = 3 x 4 x 12 x 256 / 768 = 48 -> 54 + 12 + 48 = 114 (bf16), 108 + 12 + 48 = 168 (fp32)
    assert layer_saved_bytes(GLM_BASE, 2, 256, 2, dropout=True) == 114 * sbh
    assert layer_saved_bytes(GLM_BASE, 2, 256, 4, dropout=True) == 168 * sbh
    # on CUDA the fused kernels: as without dropout plus two 1-byte masks
    assert layer_saved_bytes(GLM_BASE, 2, 256, 2, dropout=True, device="cuda") == 60 * sbh


def test_rmsnorm_swiglu_block_by_hand():
    # h = 256, i = 512, bf16, per token in bytes / h: norm inputs 2 x 4 (fp32) + 2 x (Q, K, V, out 4 + gate, SiLU,
    # up 3 x 2 + linear inputs 3 + 2 + norm outputs 2) = 8 + 2 x 17 = 42; frozen: 8 + 2 x 10 = 28
    arch = Arch(hidden=256, layers=1, heads=4, vocab=512, positions=256, family="llama", kv_heads=2,
                intermediate=512)
    sbh = 2 * 128 * 256
    assert layer_saved_bytes(arch, 2, 128, 2) == 42 * sbh
    assert layer_saved_bytes(arch, 2, 128, 2, linear_inputs=0, trained_norms=False) == 28 * sbh
    # fp32: 8 + 4 x 17 = 76
    assert layer_saved_bytes(arch, 2, 128, 4) == 76 * sbh
    with pytest.raises(ValueError, match="no residual dropout"):
        layer_saved_bytes(arch, 2, 128, 2, dropout=True)


def _one_block_saves(build, vocab: int, batch: int, seq: int) -> int:
    """Bytes of autograd's saved tensors in one block: a 2-block backbone's less a 1-block one's (so the
    embeddings cancel), weights left out, each storage once; `build(layers)` makes the bf16 backbone."""
    import torch

    def saved(layers: int) -> int:
        torch.manual_seed(0)
        model = build(layers).to(torch.bfloat16).train()
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, vocab, (batch, seq)))
        return sum(seen.values())

    return saved(2) - saved(1)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("frozen", [False, True])
def test_standin_block_matches_autograds_saved_tensors(dropout, frozen):
    """Autograd's saved tensors of one GPT-2 block, bf16, on this machine's torch and transformers."""
    from transformers import GPT2Config, GPT2Model

    batch, seq = 2, 128
    arch = Arch(hidden=256, layers=1, heads=4, vocab=512, positions=256)

    def build(layers: int):
        config = GPT2Config(vocab_size=arch.vocab, n_positions=arch.positions, n_embd=arch.hidden, n_layer=layers,
                            n_head=arch.heads, n_inner=4 * arch.hidden, activation_function="gelu_new",
                            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        return _frozen(GPT2Model(config), "h", frozen)

    measured = _one_block_saves(build, arch.vocab, batch, seq)
    predicted = layer_saved_bytes(arch, batch, seq, 2, dropout > 0, "cpu", 0 if frozen else 7)
    # LayerNorm statistics and the attention's log-sum-exp are left out: under 1 %
    assert measured == pytest.approx(predicted, rel=0.01)


def _frozen(model, blocks: str, frozen: bool):
    if frozen:
        getattr(model, blocks).requires_grad_(False)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "glm"])
@pytest.mark.parametrize("frozen", [False, True])
def test_llama_style_blocks_match_autograds_saved_tensors(family, frozen):
    """Autograd's saved tensors of one block of each Llama-style family, bf16, grouped-query attention (2 K/V
    heads for 4), a SwiGLU of 2h; frozen: the blocks' weights and norms."""
    from bench.run.models import CLASSES, family_config
    from bench.run.spec import ModelSpec

    batch, seq = 2, 128
    arch = Arch(hidden=256, layers=1, heads=4, vocab=512, positions=256, family=family, kv_heads=2, intermediate=512)

    def build(layers: int):
        spec = ModelSpec(name="census", path=None, hidden=256, layers=layers, heads=4, vocab=512, positions=256,
                         dropout=0.0, lr={"sft": 1, "rm": 1, "actor": 1, "critic": 1}, arch=family, kv_heads=2,
                         intermediate=512)
        return _frozen(CLASSES[family][2](family_config(spec)), "layers", frozen)

    measured = _one_block_saves(build, arch.vocab, batch, seq)
    predicted = layer_saved_bytes(arch, batch, seq, 2, linear_inputs=0 if frozen else None, trained_norms=not frozen)
    if family == "glm":  # GLM-4 re-interleaves cos and sin for each block: 2 x seq x head_dim / 2 values, whatever
        predicted += 2 * seq * (256 // 4 // 2) * 2  # the batch (the model leaves them out)
    # the norms' rsqrt and the attention's log-sum-exp are left out: under 1 %
    assert measured == pytest.approx(predicted, rel=0.01)


def test_terms_add_and_peak():
    a, b = Terms(params=1, host=5), Terms(params=2, activations=3)
    assert (a + b).device == 6 and (a + b).host == 5
    assert peak(a, b) is b


def test_lora_dropout_keeps_a_dropped_copy_and_a_mask_per_adapted_module_by_hand():
    llama_base = Arch(hidden=768, layers=12, heads=12, vocab=32000, positions=2048, family="llama", kv_heads=4,
                      intermediate=2048)
    # q and v (peft's Llama default): two modules reading h each -> 2 dropped copies + 2 masks = 4 h-values on the
    # CPU (the mask in bf16), 2 x (1 + 1/2) = 3 on CUDA (1-byte masks); linear_inputs shares one: 1
    assert llama_base.lora_dropout_inputs(("q", "v"), "cpu", 2) == 4
    assert llama_base.lora_dropout_inputs(("q", "v"), "cuda", 2) == 3
    assert llama_base.linear_inputs(("q", "v")) == 1
    # all seven: six modules read h, down reads i = 2048 -> (6 + 2048/768) x 2
    assert llama_base.lora_dropout_inputs(MEANINGS, "cpu", 2) == pytest.approx((6 + 2048 / 768) * 2)
    # GPT-2's q, k, v are one module (c_attn): one dropout, one copy
    assert GLM_BASE.lora_dropout_inputs(("q", "k", "v"), "cpu", 2) == 2


@pytest.mark.parametrize("targets", [("q", "v"), MEANINGS])
def test_peft_lora_dropout_saves_match_autograd(targets):
    """Autograd's saved tensors of one llama block with peft LoRA (r 8, dropout 0.1 as trlx's), bf16, on this
    machine's torch, transformers and peft: the physics with lora_dropout_inputs in place of linear_inputs."""
    from peft import LoraConfig, get_peft_model

    from bench.run.families import family as family_of
    from bench.run.models import CLASSES, family_config
    from bench.run.spec import ModelSpec

    batch, seq = 2, 128
    arch = Arch(hidden=256, layers=1, heads=4, vocab=512, positions=256, family="llama", kv_heads=2, intermediate=512)
    modules = sorted({family_of("llama").modules[m] for m in targets})

    def build(layers: int):
        spec = ModelSpec(name="census", path=None, hidden=256, layers=layers, heads=4, vocab=512, positions=256,
                         dropout=0.0, lr={"sft": 1, "rm": 1, "actor": 1, "critic": 1}, arch="llama", kv_heads=2,
                         intermediate=512)
        model = CLASSES["llama"][2](family_config(spec))
        return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=modules))

    measured = _one_block_saves(build, arch.vocab, batch, seq)
    predicted = layer_saved_bytes(arch, batch, seq, 2, linear_inputs=arch.lora_dropout_inputs(targets, "cpu", 2),
                                  trained_norms=False)
    # lora_A's outputs (r values per module) and the norms' rsqrt are left out: under 1 %
    assert measured == pytest.approx(predicted, rel=0.01)
