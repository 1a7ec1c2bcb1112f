"""Composes the Hydra config without the CLI (tests, scripts) and turns it into a plain dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config minus Hydra's own node, as stored in every record."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    return plain


def compose(overrides: list[str] | None = None) -> dict[str, Any]:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return to_plain(hydra_compose(config_name="config", overrides=list(overrides or [])))
