"""Lazy registry of framework adapters: names map to import paths, nothing heavy is imported here.

Frameworks pin conflicting dependencies, so the core only ever imports the selected adapter, and only
inside a worker process.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AdapterEntry:
    options: str  # "module:Class" of the option validator (imports no framework)
    adapter: str  # "module:Class" of the adapter (imports the framework lazily)
    memory: str | None = None  # "module:function" of its memory model (bench.plan; imports no framework)
    space: str | None = None  # "module:SPACE" of its layout space and behaviours (bench.plan.framework_space)
    # stages its upstream cannot run, each with the reason a user is told
    unsupported: tuple[tuple[str, str], ...] = (("grpo", "it has no GRPO trainer (only TRL's GRPOTrainer runs "
                                                         "stage=grpo: framework=trl)"),)


_ENTRIES: dict[str, AdapterEntry] = {
    "dschat": AdapterEntry(
        options="adapters.dschat.options:DSChatOptions",
        space="adapters.dschat.plan_space:SPACE",
        memory="adapters.dschat.memory:predict",
        adapter="adapters.dschat.adapter:DSChatAdapter",
    ),
    "colossalai": AdapterEntry(
        options="adapters.colossalai.options:ColossalOptions",
        space="adapters.colossalai.plan_space:SPACE",
        memory="adapters.colossalai.memory:predict",
        adapter="adapters.colossalai.adapter:ColossalAdapter",
    ),
    "trlx": AdapterEntry(
        options="adapters.trlx.options:TrlxOptions",
        space="adapters.trlx.plan_space:SPACE",
        memory="adapters.trlx.memory:predict",
        adapter="adapters.trlx.adapter:TrlxAdapter",
    ),
    "trl": AdapterEntry(  # Hugging Face TRL, the package itself (package `hf_trl`: not `trl`)
        options="adapters.hf_trl.options:TrlOptions",
        memory="adapters.hf_trl.memory:predict",
        space="adapters.hf_trl.plan_space:SPACE",
        adapter="adapters.hf_trl.adapter:TrlAdapter",
        unsupported=(),
    ),
    "torch": AdapterEntry(  # the plain-PyTorch reference, the yardstick (package `reference`: not `torch`)
        options="adapters.reference.options:ReferenceOptions",
        space="adapters.reference.plan_space:SPACE",
        memory="adapters.reference.memory:predict",
        adapter="adapters.reference.adapter:ReferenceAdapter",
    ),
}


def names() -> tuple[str, ...]:
    return tuple(_ENTRIES)


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def check_stages(name: str, stages: tuple[str, ...]) -> None:
    """Refuses a stage the framework's upstream does not have, naming why."""
    from bench.run.spec import UnsupportedError

    for stage, why in _ENTRIES[name].unsupported:
        if stage in stages:
            raise UnsupportedError(f"stage={stage} with framework={name}: {why}")


def options_class(name: str) -> Any:
    return _load(_ENTRIES[name].options)


def adapter_class(name: str) -> Any:
    return _load(_ENTRIES[name].adapter)


def package(name: str) -> str:
    """The adapter's package under adapters/ (`reference` for the framework named `torch`)."""
    return _ENTRIES[name].options.split(".")[1]


def memory_model(name: str) -> Any | None:
    """The framework's memory model (RunShape -> {phase: Terms}), or None where it has none yet."""
    path = _ENTRIES[name].memory
    return _load(path) if path else None


def plan_space(name: str) -> Any:
    """The framework's declared layout space and behaviours (bench.plan.framework_space.FrameworkSpace)."""
    return _load(_ENTRIES[name].space)


def zero0_own_engine(name: str) -> bool:
    """Whether the framework's ZeRO-0 runs on another engine than its ZeRO stages (its memory model's
    ZERO0_OWN_ENGINE), so that the memory model's calibration fits it apart."""
    path = _ENTRIES[name].memory
    return bool(path) and bool(getattr(importlib.import_module(path.partition(":")[0]), "ZERO0_OWN_ENGINE", False))
