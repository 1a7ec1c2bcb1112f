"""DS-Chat's Hybrid Engine on CUDA with a GPT-2 model: DeepSpeed's own classes say the defect is there (its GPT-2
policy is one the engine picks, its container lacks the engine's interface), and the adapter's refusal names it
for a model of GPT2Block layers only. The failure itself was measured on an H200 (docs/gpus.md)."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

from adapters.dschat import hybrid_engine


def test_deepspeed_s_gpt2_container_is_the_one_without_the_hybrid_engine_interface():
    from deepspeed.module_inject.containers import DS_GPT2Container, DS_OPTContainer, HFGPT2LayerPolicy
    from deepspeed.module_inject.containers.features.hybrid_engine import HybridEngineContainer
    from deepspeed.module_inject.replace_policy import replace_policies
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    assert HFGPT2LayerPolicy in replace_policies  # the Hybrid Engine builds a container for every such policy
    HFGPT2LayerPolicy(None)  # as populate_all_inference_policies does: records the layer class it replaces
    assert HFGPT2LayerPolicy._orig_layer_class is GPT2Block
    assert issubclass(DS_OPTContainer, HybridEngineContainer)  # DS-Chat's own example models
    assert not issubclass(DS_GPT2Container, HybridEngineContainer)
    assert hybrid_engine.container_lacks_hybrid_interface()


def test_the_refusal_names_the_defect_for_gpt2_layers_only():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    opt = OPTForCausalLM(OPTConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, ffn_dim=32,
                                   vocab_size=32, max_position_embeddings=16, word_embed_proj_dim=16))
    message = hybrid_engine.refusal(gpt2)
    assert message is not None and hybrid_engine.DEFECT_ID in message and "hybrid_engine=false" in message
    assert hybrid_engine.refusal(opt) is None
