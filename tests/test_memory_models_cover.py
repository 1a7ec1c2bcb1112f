"""Every framework's memory model predicts, without error, every model preset and stage the framework runs, on a
CPU host and on a GPU: a run records a model's failure only as a warning (its `prediction.error`), so a preset or
knob the model does not handle would otherwise go unseen. The oracle beyond "no exception": bytes are finite and
no phase holds a negative amount on the device or the host."""

from __future__ import annotations

import math
import os

import pytest

from adapters import registry
from bench.plan.predict import physics
from bench.run.config import compose
from bench.run.spec import SpecError, UnsupportedError, spec_from_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "conf", "model"))
                 if f.endswith(".yaml") and f != "checkpoint.yaml")  # checkpoint reads a directory's config.json
STAGES = ("sft", "rm", "ppo", "grpo")
# the knobs whose branches the models take apart: ZeRO stages, offload, LoRA, precision
VARIANTS = ({"zero": 0}, {"zero": 2}, {"zero": 3}, {"zero": 2, "offload": True}, {"zero": 2, "lora": 8},
            {"zero": 3, "lora": 8, "precision": "fp32"})


def _runs(framework: str, stage: str) -> bool:
    try:
        registry.check_stages(framework, (stage,))
    except UnsupportedError:
        return False
    return True


@pytest.mark.parametrize("framework", registry.names())
def test_every_preset_and_stage_is_predicted_with_sane_bytes(framework) -> None:
    model = registry.memory_model(framework)
    assert model is not None, f"{framework} has no memory model"
    stages = [s for s in STAGES if _runs(framework, s)]
    predicted = 0
    for preset in PRESETS:
        base = spec_from_config(compose([f"framework={framework}", f"model={preset}", "stage=ppo"]), env={},
                                check=False)
        for variant in VARIANTS:
            spec = base.replace(**variant)
            try:
                registry.options_class(framework).validate(spec)
            except SpecError:
                continue  # the framework refuses it before a run, so no run asks its model
            for stage in stages:
                for device in ("cpu", "cuda"):
                    phases = physics(spec, stage, device)
                    assert phases, (preset, variant, stage, device)
                    for phase, terms in phases.items():
                        values = terms.as_dict()
                        assert all(math.isfinite(v) for v in values.values()), (preset, variant, stage, phase)
                        assert terms.device >= 0 and terms.host >= 0, (preset, variant, stage, device, phase, values)
                    predicted += 1
    assert predicted >= len(PRESETS) * len(stages) * 2, predicted  # most of the grid is predicted, not refused
