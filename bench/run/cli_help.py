"""`python -m bench.run --help`: every framework, stage and model preset with one line about each.

The lines come from the `# help:` comment that opens each file of conf/framework, conf/stage and conf/model,
so a preset added there is listed with its own description; a file without one is listed as such.
"""

from __future__ import annotations

import os

import yaml

from bench.run.config import CONF_DIR

GROUPS = ("framework", "stage", "model")
HELP_PREFIX = "# help:"
USAGE = """\
rlhf-bench: SFT, RM, PPO, GRPO through an RLHF framework, measured: peak memory
per phase, throughput, numerical stability.

Usage: python -m bench.run [KEY=VALUE ...]
       python -m bench.run -m KEY=V1,V2 ...   (a sweep: a run per combination)
       python -m bench.run --dry-run [-m] ... (what would run, each cell
                                               checked; nothing launched)
       python -m bench.run plan=FILE framework=NAME ... (an execution plan
                                               as the framework's knobs)
"""
FOOTER = """\
Common keys: precision=fp32|bf16|fp16 zero=0|1|2|3 lora=RANK batch=N steps=N
  launcher.nproc=N init.sft=FILE init.rm=FILE
  verbose=true (the engines' own output on the terminal too; always in the log)
Every key, its default and what it does: conf/config.yaml
  (the resolved values: python -m bench.run --cfg job; Hydra's: --hydra-help)
A run writes results/runs/<run>/record.json; a report of every run so far:
  python -m bench.report results/runs"""


def describe(path: str) -> str:
    """The one-line description a config file opens with."""
    with open(path) as f:
        first = f.readline().strip()
    if not first.startswith(HELP_PREFIX):
        return "(no description)"
    text = first[len(HELP_PREFIX):].strip()
    if os.path.basename(os.path.dirname(path)) == "framework":
        with open(path) as f:
            precision = (yaml.safe_load(f) or {}).get("default_precision")
        text += f" [{precision}]" if precision else ""
    return text


def presets(group: str) -> list[tuple[str, str]]:
    directory = os.path.join(CONF_DIR, group)
    names = sorted(f[:-len(".yaml")] for f in os.listdir(directory) if f.endswith(".yaml"))
    return [(name, describe(os.path.join(directory, f"{name}.yaml"))) for name in names]


def defaults() -> dict[str, str]:
    """Each group's default, as conf/config.yaml's defaults list names it."""
    with open(os.path.join(CONF_DIR, "config.yaml")) as f:
        entries = yaml.safe_load(f)["defaults"]
    return {k: v for entry in entries if isinstance(entry, dict) for k, v in entry.items()}


def help_text() -> str:
    lines = [USAGE]
    chosen = defaults()
    for group in GROUPS:
        lines.append(f"{group}=NAME (default {chosen[group]}):")
        entries = presets(group)
        width = max(len(name) for name, _ in entries)
        lines.extend(f"  {name:<{width}}  {text}" for name, text in entries)
        lines.append("")
    lines.append(FOOTER)
    return "\n".join(lines)
