"""Which parameters train under each framework's LoRA, against the upstream rule (real modules, no engine).

DS-Chat (dschat/utils/module/lora.py): LinearLayer_LoRA freezes only the weight it wraps; the bias and
every unconverted parameter keep training unless the opt-in only_optimize_lora freezes all but LoRA.
ColossalChat (coati/models/lora.py): everything frozen first; linear layers get alpha 32 and no dropout
whatever the config says, and with train_bias="none" their bias is dropped. Trlx: peft LoRA on c_attn
plus a fully trained value head; the hydra freeze leaves the position table trainable; the RM example
freezes blocks[:-int(0.3 * layers)].
"""

from __future__ import annotations

import pytest
import torch

from bench.run.models import build_causal_lm, gpt2_config
from bench.run.spec import ModelSpec

MODEL = ModelSpec(name="t", path=None, hidden=32, layers=4, heads=2, vocab=64, positions=32, dropout=0.1,
                  lr={"sft": 1e-3, "rm": 1e-3, "actor": 1e-3, "critic": 1e-3})


def trainable(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def test_dschat_lora_freezes_only_the_wrapped_weights():
    from adapters.dschat.lora import convert_to_lora

    model = build_causal_lm(MODEL)
    converted = convert_to_lora(model, "h.", rank=4)
    assert converted == 4 * MODEL.layers  # c_attn, c_proj (attention), c_fc, c_proj (MLP) per block
    names = trainable(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {f"transformer.h.{i}.{m}.base.weight" for i in range(MODEL.layers)
                      for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert "transformer.h.0.attn.c_attn.base.bias" in names  # the wrapped layer's bias trains
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight"} <= names
    assert "transformer.h.0.attn.c_attn.lora_right_weight" in names


def test_dschat_only_optimize_lora_is_opt_in_and_keeps_forced_params():
    from adapters.dschat.lora import convert_to_lora, only_optimize_lora
    from adapters.dschat.options import DSChatOptions

    assert DSChatOptions().only_optimize_lora is False and DSChatOptions().critic_lora_dim == 0
    model = build_causal_lm(MODEL)
    convert_to_lora(model, "h.", rank=4)
    only_optimize_lora(model, keep_trainable=("ln_f",))
    assert trainable(model) == ({f"transformer.h.{i}.{m}.{w}" for i in range(MODEL.layers)
                                 for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
                                 for w in ("lora_right_weight", "lora_left_weight")}
                                | {"transformer.ln_f.weight", "transformer.ln_f.bias"})


@pytest.mark.parametrize("preset, blocks", [(None, "h."), ("tiny-llama", "layers.")])
def test_dschat_lora_saves_a_plain_model_that_computes_the_same(preset, blocks):
    """GPT-2's Conv1D layers with their biases and Llama's bias-free Linear projections: the saved state, the
    adapters folded in, loads into a plain model whose logits are the LoRA model's own."""
    from adapters.dschat.lora import convert_to_lora, fused_state_dict
    from bench.run.config import compose

    spec = MODEL if preset is None else ModelSpec(**compose([f"model={preset}"])["model"])
    torch.manual_seed(0)
    model = build_causal_lm(spec).eval()
    assert convert_to_lora(model, blocks, rank=4) > 0
    ids = torch.randint(2, spec.vocab, (2, 8))
    untrained = model(ids).logits
    for name, p in model.named_parameters():
        if "lora_left_weight" in name:
            torch.nn.init.normal_(p, std=0.02)  # a trained adapter: no longer zero
    trained = model(ids).logits
    assert not torch.allclose(trained, untrained, atol=1e-4)  # the adapters move the output: folding them counts
    plain = build_causal_lm(spec).eval()
    plain.load_state_dict(fused_state_dict(model))  # strict: every key of the plain model, no other
    assert torch.allclose(plain(ids).logits, trained, atol=1e-4)


@pytest.mark.parametrize("train_bias", ["none", "all", "lora"])
def test_coati_lora_trains_adapters_and_the_biases_its_mode_keeps(train_bias):
    from adapters.colossalai.lora import LINEAR_ALPHA, LoraLinear, convert_to_lora
    from adapters.colossalai.options import LoraOptions

    model = build_causal_lm(MODEL)
    options = LoraOptions(alpha=8.0, train_bias=train_bias)
    convert_to_lora(model, rank=4, options=options)
    names = trainable(model)
    lora = {n for n in names if "lora_" in n}
    assert lora and all(".lora_A" in n or ".lora_B" in n for n in lora)
    linear = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert all(m.scaling == LINEAR_ALPHA / 4 for m in linear)  # the config's alpha never reaches a linear layer
    assert not any(isinstance(m, torch.nn.Dropout) for layer in linear for m in layer.modules())
    wrapped_bias = "transformer.h.0.attn.c_attn.bias"
    all_names = {n for n, _ in model.named_parameters()}
    if train_bias == "none":
        assert names == lora
        assert wrapped_bias not in all_names  # dropped, not frozen
        assert "transformer.h.0.ln_1.bias" in all_names  # a LayerNorm is not wrapped: its bias stays, frozen
    elif train_bias == "all":
        assert names == lora | {n for n in all_names if "bias" in n}
    else:
        assert names == lora | {n for n in all_names if n.endswith("bias") and "ln_" not in n}
        assert "lm_head.bias" in names  # a wrapped layer without a bias gets a fresh zero one


def test_coati_lora_with_a_dropped_bias_saves_a_plain_model_that_computes_the_same():
    from adapters.colossalai.lora import convert_to_lora, merged_state_dict
    from adapters.colossalai.options import LoraOptions

    torch.manual_seed(0)
    model = build_causal_lm(MODEL).eval()
    convert_to_lora(model, rank=4, options=LoraOptions())
    for name, p in model.named_parameters():
        if "lora_B" in name and name.startswith("transformer.h."):  # GPT-2 ties lm_head to wte: leave those
            torch.nn.init.normal_(p, std=0.02)  # a trained adapter: B is no longer zero
    ids = torch.randint(2, MODEL.vocab, (2, 8))
    plain = build_causal_lm(MODEL).eval()
    plain.load_state_dict(merged_state_dict(model))
    assert torch.allclose(plain(ids).logits, model(ids).logits, atol=1e-4)


def test_trlx_peft_lora_trains_adapters_and_the_whole_value_head():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from adapters.trlx.models import PolicyWithValueHead

    lm = get_peft_model(build_causal_lm(MODEL), LoraConfig(r=4, lora_alpha=32, lora_dropout=0.1,
                                                          task_type="CAUSAL_LM"))
    policy = PolicyWithValueHead(lm, MODEL.hidden, hydra_layers=0)
    names = trainable(policy)
    assert {n for n in names if n.startswith("v_head.")} == {n for n, _ in policy.v_head.named_parameters(
        prefix="v_head")}
    rest = names - {n for n in names if n.startswith("v_head.")}
    assert rest and all("lora_" in n and "c_attn" in n for n in rest)


def test_trlx_hydra_freeze_leaves_the_position_table_and_top_blocks_trainable():
    from adapters.trlx.models import freeze_bottom_layers

    lm = build_causal_lm(MODEL)
    freeze_bottom_layers(lm, 2)
    names = trainable(lm)
    assert "transformer.wpe.weight" in names  # freeze_bottom_causal_layers freezes input embeddings only
    assert "transformer.wte.weight" not in names  # ... and the LM head tied to them
    assert any(n.startswith("transformer.h.3.") for n in names) and any(n.startswith("transformer.h.2.") for n in names)
    assert not any(n.startswith(("transformer.h.0.", "transformer.h.1.")) for n in names)


@pytest.mark.parametrize(("layers", "frozen_blocks"), [(4, 3), (10, 7), (3, 0)])
def test_trlx_rm_freezes_the_bottom_70_percent_with_upstreams_slice(layers, frozen_blocks):
    from transformers import GPT2Model

    from adapters.trlx.models import GPTRewardModel, freeze_reward_backbone

    spec = ModelSpec(**{**MODEL.__dict__, "layers": layers})
    model = GPTRewardModel(GPT2Model(gpt2_config(spec)), spec.hidden)
    freeze_reward_backbone(model, 0.3)
    frozen = [i for i, block in enumerate(model.transformer.h) if not any(p.requires_grad for p in block.parameters())]
    assert frozen == list(range(frozen_blocks))  # int(0.3 * 3) = 0 and blocks[:-0] is empty: nothing frozen
    assert model.v_head.weight.requires_grad and model.transformer.wte.weight.requires_grad
