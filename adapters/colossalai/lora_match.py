"""Which block layers coati's LoRA converts for a set of lora_targets (torch-free: the memory model reads it).

coati's `_convert_to_lora_recursively` converts a child when its own name is a substring of one of
`target_modules`; the adapter passes the targets' qualified suffixes (attn.c_attn, attn.c_proj, mlp.c_fc,
mlp.c_proj). GPT-2 names the attention output and the MLP output both `c_proj`, so either target converts
both: on this stand-in coati cannot adapt one without the other.
"""

from __future__ import annotations

from adapters.lora_targets import BLOCK_LAYERS, suffixes


def matched_layers(targets: tuple[str, ...]) -> tuple[str, ...]:
    """The lora_targets names of the block layers coati converts when given `targets`."""
    names = suffixes(targets)
    return tuple(t for t, suffix in BLOCK_LAYERS.items() if any(suffix.rsplit(".", 1)[1] in n for n in names))
