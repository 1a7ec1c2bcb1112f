"""DeepSpeed 0.19.8's Hybrid Engine cannot build its inference module for a GPT-2 model on CUDA: an upstream defect.

`DeepSpeedHybridEngine.populate_all_inference_policies` (runtime/hybrid_engine.py) takes every policy in
`replace_policies`, `HFGPT2LayerPolicy` among them, and `new_inference_container` then calls
`set_params_wo_copy` on the container that `policy_to_ds_container` (module_inject/utils.py) maps the policy to.
That method belongs to `HybridEngineContainer` (module_inject/containers/features/hybrid_engine.py), which the
OPT, BLOOM, GPT-J, GPT-Neo(X), Llama and InternLM containers mix in and `DS_GPT2Container` does not. So
`deepspeed.initialize` with `hybrid_engine.enabled` on a model of `GPT2Block`s fails with
`AttributeError: 'DS_GPT2Container' object has no attribute 'set_params_wo_copy'` (measured on an H200:
scripts/gpu_check.py, base-z2-dschat-he). On the CPU the adapter strips every policy (no inference kernels
exist there), so the defect only shows on CUDA.

The harness does what a DS-Chat user gets, but says why before the engine is built: the run is `unsupported`
with this defect named, instead of an AttributeError from deep inside `initialize`.
"""

from __future__ import annotations

from torch import nn

DEFECT_ID = "deepspeed-0.19.8-hybrid-engine-gpt2-container"
WHERE = ("deepspeed 0.19.8 runtime/hybrid_engine.py new_inference_container -> set_params_wo_copy, which "
         "module_inject/containers/gpt2.py DS_GPT2Container lacks (no HybridEngineContainer)")


def container_lacks_hybrid_interface() -> bool:
    """True while DeepSpeed's GPT-2 container misses the method the Hybrid Engine calls on every container."""
    from deepspeed.module_inject.containers import DS_GPT2Container

    return not hasattr(DS_GPT2Container, "set_params_wo_copy")


def refusal(model: nn.Module) -> str | None:
    """Why the Hybrid Engine cannot run `model` on CUDA, or None when nothing in it meets the defect."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    if not any(isinstance(module, GPT2Block) for module in model.modules()):
        return None
    if not container_lacks_hybrid_interface():
        return None
    return (f"framework.hybrid_engine=true on CUDA: upstream defect {DEFECT_ID}: {WHERE}; deepspeed.initialize "
            "fails on a model of GPT2Block layers (DS-Chat's Hybrid Engine supports OPT, BLOOM, GPT-J, GPT-Neo(X), "
            "Llama and InternLM layers). Run without the Hybrid Engine (framework.hybrid_engine=false)")
