"""Optional installs a run needs, checked before anything is launched: a missing one is named with the command
that installs it (pyproject.toml's extras; colossalai itself is the one package scripts/setup.sh installs outside
pip's resolver, see there)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from bench.run.spec import SpecError


class MissingExtraError(SpecError):
    """A module the run needs is not installed; nothing was launched."""


@dataclass(frozen=True)
class Extra:
    modules: tuple[str, ...]  # import names
    install: str  # what installs them


COLOSSALAI = Extra(("colossalai", "einops", "galore_torch", "bitsandbytes"),
                   "bash scripts/setup.sh installs them; by hand: pip install -e '.[colossalai]' && "
                   "pip install --no-deps colossalai==0.5.0 (its metadata pins torch<=2.5.1: pyproject.toml)")
BITSANDBYTES = Extra(("bitsandbytes",), "pip install -e '.[bitsandbytes]' (scripts/setup.sh installs it)")
# by framework: what its runs import beyond the project's requirements
FRAMEWORK_EXTRAS = {"colossalai": COLOSSALAI}


def missing(extra: Extra) -> list[str]:
    """The extra's modules that cannot be imported here (found without importing them)."""
    return [name for name in extra.modules if importlib.util.find_spec(name) is None]


def require(extra: Extra, what: str) -> None:
    """Raises MissingExtraError naming `what` needs them, the modules missing and how to install them."""
    absent = missing(extra)
    if absent:
        raise MissingExtraError(f"{what} needs {', '.join(absent)}, not installed: {extra.install}")
