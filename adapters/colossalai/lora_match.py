"""Which block layers coati's LoRA converts for a set of lora_targets (torch-free: the memory model reads it).

coati's `_convert_to_lora_recursively` converts a child when its own name is a substring of one of
`target_modules`; the adapter passes the targets' qualified suffixes (GPT-2: attn.c_attn, attn.c_proj,
mlp.c_fc, mlp.c_proj; Llama-style: self_attn.q_proj, ..., mlp.down_proj). GPT-2 names the attention output and
the MLP output both `c_proj`, so either target converts both: on the GLM stand-in coati cannot adapt one without
the other. The Llama-style names are distinct, so the rule converts exactly the targets there.
"""

from __future__ import annotations

from adapters.lora_targets import suffixes
from bench.run.families import family


def matched_layers(targets: tuple[str, ...], arch: str = "gpt2") -> tuple[str, ...]:
    """The meanings of the block maps coati converts in a model of `arch` when given `targets`."""
    names = suffixes(targets, arch)
    traits = family(arch)
    return tuple(m for m in traits.meanings if any(traits.modules[m].rsplit(".", 1)[1] in n for n in names))
