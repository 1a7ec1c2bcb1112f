"""The common knobs the published claims turn: their validation. That each reaches the built engine is read back
from the engines in the adapters' own pipeline tests (the upstream defaults) and in
tests/test_quantize.py (a threshold set for PPO's trained roles)."""

from __future__ import annotations

import pytest

from bench.run.config import compose
from bench.run.spec import SpecError, UnsupportedError, spec_from_config


@pytest.mark.parametrize("value", [-0.5, "high", True])
def test_grad_clip_must_be_a_threshold(value: object) -> None:
    with pytest.raises(SpecError, match="grad_clip"):
        spec_from_config(compose([f"grad_clip={str(value).lower() if isinstance(value, bool) else value}"]))


def test_grad_clip_overrides_the_upstream_default_only_when_set() -> None:
    assert spec_from_config(compose([])).grad_clip_or(1.0) == 1.0
    assert spec_from_config(compose(["grad_clip=0.25"])).grad_clip_or(1.0) == 0.25
    assert spec_from_config(compose(["grad_clip=0"])).grad_clip_or(1.0) == 0.0  # off


def test_coati_ddp_refuses_a_clip_it_cannot_apply() -> None:
    with pytest.raises(UnsupportedError, match="TorchDDPPlugin takes no max_norm"):
        spec_from_config(compose(["framework=colossalai", "stage=sft", "precision=fp32", "plugin=ddp",
                                  "grad_clip=0.5"]))


def test_trlx_clipping_under_ddp_is_a_tagged_extension() -> None:
    from adapters.trlx.options import TrlxOptions

    spec = spec_from_config(compose(["framework=trlx", "stage=sft", "zero=0", "grad_clip=0.5"]))
    assert [e["knob"] for e in TrlxOptions.harness_extensions(spec)] == ["grad_clip=0.5 at zero=0"]
