"""Checks of `python -m bench.run`'s command line that run before Hydra creates anything.

Hydra answers an unknown key, a config-group choice that does not exist or an unwritable output
directory with a traceback-like message and exit status 1, after it has made the run directory. These
checks answer them first, with the value and what is allowed, exit status 2, and nothing written. A
single run's whole configuration is also validated here (a sweep validates each cell and keeps a record
of the ones that cannot run, so that the sweep goes on).
"""

from __future__ import annotations

import difflib
import itertools
import os
import tempfile
from typing import Any

from bench.run.config import CONF_DIR, compose
from bench.run.spec import SpecError, UnsupportedError, spec_from_config

# Hydra's own flags that only print (help, the config, info): nothing runs, so nothing is checked.
PRINT_ONLY_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--resolve", "--version",
                    "--shell-completion", "-sc")
MULTIRUN_FLAGS = ("-m", "--multirun")
# Config groups under conf/ that are not a run's choices: execution plans, read as plan=FILE before Hydra
# (bench.run.plan_run.expand) and by `python -m bench.plan --check`.
NOT_RUN_GROUPS = ("plan",)


def config_groups() -> dict[str, tuple[str, ...]]:
    """Each config group under conf/ and its choices (framework: colossalai, dschat, trlx; ...)."""
    return {
        group.name: tuple(sorted(p.stem for p in group.glob("*.yaml")))
        for group in sorted(CONF_DIR.iterdir()) if group.is_dir() and group.name not in NOT_RUN_GROUPS
    }


def _has_key(config: dict[str, Any], dotted: str) -> bool:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _keys(config: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in config.items():
        out.append(prefix + key)
        if isinstance(value, dict):
            out.extend(_keys(value, f"{prefix}{key}."))
    return out


def _unknown_key(key: str, configs: list[dict[str, Any]]) -> SpecError:
    known = sorted(set(itertools.chain.from_iterable(_keys(c) for c in configs)))
    close = difflib.get_close_matches(key, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return SpecError(f"{key} is not a key of the configuration{hint} "
                     "(`python -m bench.run --help` lists every key with its default)")


def check_output_root(path: str) -> None:
    """The results directory (or the deepest part of it that exists) must be a directory this process can
    write: probed by creating and removing a temporary directory, since os.access says yes to root."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise SpecError(f"output_root={path!r} cannot be created: {existing} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=existing))
    except OSError as err:
        raise SpecError(f"output_root={path!r} is not writable: making a directory in {existing} failed "
                        f"({err.strerror})") from None


def check_command_line(args: list[str]) -> None:
    """Raise SpecError for a command line that names a key, group choice or output directory that cannot
    work; for a single run, also for any invalid value. Unsupported combinations pass: the run records them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if any(arg in PRINT_ONLY_FLAGS for arg in args):
        return
    sweeping = any(arg in MULTIRUN_FLAGS for arg in args)
    texts = [arg for arg in args if not arg.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(texts)
    except HydraException as err:
        raise SpecError(f"{str(err).splitlines()[0]}: write KEY=VALUE (a sweep: KEY=V1,V2 with -m)") from None
    groups = config_groups()
    choices: dict[str, list[str]] = {}
    for override in overrides:
        key = override.key_or_group
        if key.split("/")[0].split(".")[0] == "hydra":
            continue
        if key in NOT_RUN_GROUPS:
            raise SpecError(f"{key}: an execution plan is given as plan=FILE (`python -m bench.run plan=FILE "
                            "framework=NAME` runs it; `python -m bench.plan --check plan=FILE` checks it)")
        if override.is_add() or override.is_force_add() or override.is_delete():
            sign = "~" if override.is_delete() else "+"
            raise SpecError(f"{sign}{key}: rlhf-bench reads only the keys of its configuration; set a key with "
                            f"{key}=VALUE (`python -m bench.run --help` lists them)")
        if key in groups:
            values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
            for value in values:
                if value not in groups[key]:
                    raise SpecError(f"{key}={value!r} is not allowed; choose one of: {', '.join(groups[key])}")
            choices[key] = values
    # Keys that exist only in some group choices (framework.hybrid_engine: dschat) must exist in each chosen one.
    combos = [dict(zip(choices, combo, strict=True)) for combo in itertools.product(*choices.values())] or [{}]
    configs = [compose([f"{g}={v}" for g, v in combo.items()]) for combo in combos]
    for override in overrides:
        key = override.key_or_group
        if key in groups or key.split("/")[0].split(".")[0] == "hydra":
            continue
        missing = [combo for combo, config in zip(combos, configs, strict=True) if not _has_key(config, key)]
        if len(missing) == len(configs):
            raise _unknown_key(key, configs)
        if missing:
            where = " ".join(f"{group}={value}" for group, value in missing[0].items())
            raise SpecError(f"{key} is not a key of the configuration with {where}; sweep it in a separate call")
    output_root = next((o.value() for o in reversed(overrides) if o.key_or_group == "output_root"),
                       configs[0]["output_root"])
    check_output_root(str(output_root))
    if not sweeping:
        try:
            spec_from_config(compose(texts))
        except UnsupportedError:
            pass  # the run writes an `unsupported` record: a cell a sweep would also keep
        except (HydraException, OmegaConfBaseException) as err:
            raise SpecError(str(err).splitlines()[0]) from None
