"""Published GPU facts and the planner's verdict on each: `python -m bench.plan.facts [--markdown]`.

Each file of conf/facts/ is a plan file (model, critic_model, cluster, workload, execution_plan: the
configuration the source ran, as its script runs it) plus a `fact:` block: the framework, the source and its
address, the words quoted, and what was published (it fits or it failed; where given, the per-GPU figure in MiB
and how it was measured). The fact's own framework predicts the plan as written: its declaration turns the
execution plan into its knobs, and its own memory model (adapters/<framework>/memory.py, on a GPU) gives the
per-GPU peak whose verdict is set beside the fact's.
A fact the planner still disagrees with carries `disagreement:`, the term that differs and why; the tests hold
every verdict to agree or to carry that reason.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from dataclasses import dataclass, replace
from typing import Any

import yaml

from adapters import registry
from bench.plan import plan_file
from bench.plan.cluster import GPUS, SAFETY
from bench.run.spec import UnsupportedError

FACTS_DIR = os.path.join(os.path.dirname(plan_file.CONF_MODEL_DIR), "facts")
MIB = 2**20
GIB = 2**30
# a published per-GPU figure is matched when the planner's peak is within this share of it: a plan's peak that
# far off would send a user to a different layout or GPU count
FIGURE_TOLERANCE = 0.25


@dataclass(frozen=True)
class Fact:
    name: str
    framework: str
    source: str
    url: str
    quote: str
    fits: bool  # what was published: the configuration ran (True) or ran out of memory (False)
    per_gpu_mib: float | None  # the published per-GPU figure, where one was given
    measured_as: str | None  # how that figure was measured
    disagreement: str | None  # where the planner disagrees: which term and why


@dataclass(frozen=True)
class Verdict:
    fact: Fact
    setting: str  # the configuration in the planner's words
    fits: bool  # the planner's verdict
    peak_bytes: float  # its per-GPU peak, the largest GPU group's largest phase
    limit_bytes: float  # cluster.safety of the GPU's total_memory

    @property
    def agrees(self) -> bool:
        """The verdict matches, and so does the figure where one was published (within FIGURE_TOLERANCE)."""
        return self.fits == self.fact.fits and (self.error is None or abs(self.error) <= FIGURE_TOLERANCE)

    @property
    def error(self) -> float | None:
        """(predicted - published) / published, where a figure was published."""
        if self.fact.per_gpu_mib is None:
            return None
        return self.peak_bytes / (self.fact.per_gpu_mib * MIB) - 1


def read(path: str) -> tuple[Fact, dict[str, Any]]:
    """The fact and the plan of one file; a file without a complete `fact:` block is refused by name."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as err:
        raise plan_file.PlanError(f"{path}: not YAML: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("fact"), dict):
        raise plan_file.PlanError(f"{path}: a fact file needs a `fact:` mapping beside the plan")
    fact, plan = data.pop("fact"), data
    published = fact.get("published") or {}
    missing = [k for k in ("framework", "source", "url", "quote") if not fact.get(k)]
    if missing or not isinstance(published.get("fits"), bool):
        raise plan_file.PlanError(f"{path}: fact lacks {', '.join(missing) or 'published.fits (true or false)'}")
    name = os.path.splitext(os.path.basename(path))[0]
    if fact["framework"] not in registry.names():
        raise plan_file.PlanError(f"{path}: fact.framework={fact['framework']!r} is not a framework here; allowed: "
                                  f"{', '.join(registry.names())}")
    return Fact(name, fact["framework"], fact["source"], fact["url"], fact["quote"], published["fits"],
                published.get("per_gpu_mib"), published.get("measured_as"), fact.get("disagreement")), plan


def model_overrides(model: Any) -> list[str]:
    """A fact's model as the run keys its framework's spec is built from: a conf/model preset, or an inline
    mapping of dimensions over the `tiny` preset (whose other keys, dropout 0 and the family's defaults, are the
    ones an inline mapping leaves unset)."""
    if isinstance(model, str):
        return [f"model={model}"]
    return ["model=tiny", *(f"model.{k}={v}" for k, v in model.items())]


def judge(path: str) -> Verdict:
    """The fact's configuration predicted by its own framework's declaration: the execution plan as the framework's
    knobs (its options class's `plan_knobs`, as `bench.run plan=` runs it), checked by its own `validate`, and
    predicted by its own memory model on a GPU (bench.plan.framework_plans.evaluate_point)."""
    from adapters import registry
    from bench.plan.framework_plans import PlanInputError, base_spec, evaluate_point

    fact, plan = read(path)
    name, arch, critic_arch, cluster, workload = plan_file.context(plan)
    layouts, groups = plan_file.layouts_of(plan["execution_plan"], arch, critic_arch, cluster)
    if len(groups) > 1:
        raise plan_file.PlanError(f"{path}: every framework here places every role on every GPU (one group)")
    # the Hybrid Engine's inference TP (--inference_tp_size) is a knob DS-Chat's memory model does not count (its
    # plan_space.py declares it so): the fact is predicted at the layout it trains with
    generation_tp = max(lay.generation_tp for lay in layouts.values())
    layouts = {role: replace(lay, generation_tp=0) for role, lay in layouts.items()}
    try:
        knobs = registry.options_class(fact.framework).plan_knobs(layouts)
        spec = base_spec(fact.framework, model_overrides(plan["model"]), cluster, workload)
    except (UnsupportedError, PlanInputError) as err:
        raise plan_file.PlanError(f"{path}: {err}") from None
    space = registry.plan_space(fact.framework)
    point = dict(knobs.common)
    for knob in space.knobs_for(workload) if space.knobs_for else []:
        key, value = knob.split("=", 1)
        point[key] = yaml.safe_load(value)
    found = evaluate_point(space, spec, point, arch, critic_arch, cluster, workload,
                           registry.memory_model(fact.framework))
    if isinstance(found, str):
        raise plan_file.PlanError(f"{path}: {fact.framework} refuses the configuration: {found}")
    critic = plan.get("critic_model")
    critic_name = critic["name"] if isinstance(critic, dict) else critic
    lora = f", LoRA {workload.lora}" + (f"/{workload.critic_lora}" if workload.critic_lora is not None else "") \
        if workload.lora else ""
    setting = (f"{name}" + (f" + {critic_name} critic" if critic_name else "") + f", {cluster.gpus} x {cluster.gpu}, "
               f"{workload.precision}, batch {workload.micro_batch} x {workload.prompt_len}+{workload.answer_len}"
               f"{lora}: {found.terms}" + (f" (--inference_tp_size {generation_tp} not counted)"
                                           if generation_tp > 1 else ""))
    return Verdict(fact, setting, found.fits, found.peak, found.limit)


def judge_all(directory: str = FACTS_DIR) -> list[Verdict]:
    paths = sorted(glob.glob(os.path.join(directory, "*.yaml")))
    if not paths:
        raise plan_file.PlanError(f"no fact files in {directory}")
    return [judge(p) for p in paths]


def _published(v: Verdict) -> str:
    text = "runs" if v.fact.fits else "fails (out of memory)"
    return text + (f", {v.fact.per_gpu_mib * MIB / GIB:.1f} GiB" if v.fact.per_gpu_mib else "")


def _predicted(v: Verdict) -> str:
    text = f"{'fits' if v.fits else 'does not fit'}: {v.peak_bytes / GIB:.1f} of {v.limit_bytes / GIB:.1f} GiB"
    if v.error is None:
        return text
    within = "within" if abs(v.error) <= FIGURE_TOLERANCE else "outside"
    return text + f" (figure error {v.error:+.0%}, {within} ±{FIGURE_TOLERANCE:.0%})"


def markdown(verdicts: list[Verdict]) -> str:
    """The table docs/published-facts.md shows (a test keeps the page equal to this)."""
    lines = ["| fact | source | published | setting, in the framework's own flags | its memory model, per GPU | "
             "agrees |", "|---|---|---|---|---|---|"]
    for v in verdicts:
        agrees = "yes" if v.agrees else f"no: {v.fact.disagreement or 'undeclared'}"
        lines.append(f"| `{v.fact.name}` | [{v.fact.source}]({v.fact.url}): \"{v.fact.quote}\" | {_published(v)} | "
                     f"{v.setting} | {_predicted(v)} | {agrees} |")
    agreed = sum(v.agrees for v in verdicts)
    figures = [v for v in verdicts if v.error is not None]
    matched = sum(abs(v.error) <= FIGURE_TOLERANCE for v in figures)
    lines.append("")
    lines.append(f"{agreed} of {len(verdicts)} verdicts agree; of the {len(figures)} published per-GPU figures, "
                 f"{matched} are within ±{FIGURE_TOLERANCE:.0%} of the predicted peak.")
    lines.append("")
    for framework in sorted({v.fact.framework for v in verdicts}):
        skipped = "; ".join(f"{knob} ({why})" for knob, why in registry.plan_space(framework).declared_only)
        lines.append(f"{framework}'s knobs its declaration does not search (each fact is predicted without them "
                     f"unless its setting names them): {skipped}.")
    return "\n".join(lines) + "\n"


def gpu_markdown() -> str:
    """The GPU table docs/published-facts.md shows: each card's memory as torch reports it, and where from."""
    lines = [f"| GPU | nominal | total_memory (torch), GiB | limit at {SAFETY * 100:g} %, GiB | read from |",
             "|---|---|---|---|---|"]
    for gpu in GPUS.values():
        lines.append(f"| {gpu.name} | {gpu.memory_gb:g} GB | {gpu.total_memory_gib:.2f} | "
                     f"{SAFETY * gpu.total_memory_gib:.2f} | {gpu.memory_source} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plan.facts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the table docs/published-facts.md shows")
    parser.add_argument("--dir", default=FACTS_DIR, help="the fact files (default conf/facts)")
    args = parser.parse_args(argv)
    try:
        verdicts = judge_all(args.dir)
    except (plan_file.PlanError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.markdown:
        print(markdown(verdicts), end="")
    else:
        for v in verdicts:
            mark = "agrees" if v.agrees else "DISAGREES"
            print(f"{v.fact.name}: published {_published(v)}; {v.fact.framework}'s model {_predicted(v)} -> {mark}")
    # exit 1 when a verdict disagrees without a declared reason, as `--check` exits 1 when a plan does not fit
    return 0 if all(v.agrees or v.fact.disagreement for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
