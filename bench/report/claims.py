"""The claims check: the published claims of conf/claims.yaml (docs/published-claims.md), each marked
supported / contradicted / not measurable at this scale / not measured in this sweep, with evidence.

Claims are measured as they are stated, on whatever the sweep ran; a verdict on the tiny CPU model
says so. Claims that need a GPU, GLM-10B itself, or a knob the harness does not have are marked not
measurable with the reason, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import combinations
from typing import Any

from bench.plan import claims_arithmetic as arithmetic
from bench.plan import plan_file
from bench.plan.physics import Arch
from bench.report import claims_data
from bench.report.aggregate import MIN_REPEATS, Stat, stat
from bench.report.pairs import FEW, HIGHER, LOWER, TIE_, compare, describe, matched_sets, tied
from bench.results.collect import FORCED_FAILURE, YARDSTICK, is_forced_failure, tags_of

MIB = 1024.0 * 1024.0
SUPPORTED, CONTRADICTED, PARTLY = "supported", "contradicted", "partly supported"
NOT_MEASURABLE, NOT_MEASURED = "not measurable at this scale", "not measured in this sweep"
CLAIMED_MEMORY_ORDER = ("trlx", "colossalai", "dschat")  # A1-A3: most to least memory


@dataclass
class Verdict:
    claim_id: str
    claim: str
    verdict: str
    evidence: str


Rows = list[dict[str, Any]]
Records = dict[str, dict[str, Any]]
Cells = dict[str, dict[str, Any]]
TIE = "not supported (tie)"
UNDECIDED = f"not decided (fewer than {MIN_REPEATS} repeats a side)"
# How every figure below reads a published one (stated once, above the verdicts)
UNITS = ("Units: a published \"GB\" is read as 10^9 bytes (none of the sources says GiB); measured memory is in "
         "MiB (2^20 bytes) and bounds in GB (10^9 bytes) with GiB (2^30) beside them.")
VERDICT_RULE = (f"Verdicts: supported or contradicted only where the cells compared differ in the claim's knob "
                f"alone, each has at least {MIN_REPEATS} repeats and their ranges (min to max) do not touch, in the "
                "stated direction (and, where the claim states a range, within it: else partly supported); "
                "overlapping ranges read not supported (tie); fewer repeats read not decided. Each verdict names "
                "its pairs with their n.")


def _scale_note(rows: Rows) -> str:
    models = sorted({r["model"] for r in rows})
    return f" (model {', '.join(models)}; memory method: host RSS on CPU)" if any(
        "RSS" in (r.get("memory_method") or "") for r in rows) else f" (model {', '.join(models)})"


def _combine(outcomes: list[str]) -> str:
    """One verdict from the matched sets' own: all agree -> theirs; ties (and undecided) only -> tie (undecided
    where no set had the repeats); else partly."""
    decided = [o for o in outcomes if o not in (TIE, UNDECIDED)]
    if not decided:
        return TIE if TIE in outcomes else UNDECIDED
    if all(o == SUPPORTED for o in decided) and len(decided) == len(outcomes):
        return SUPPORTED
    if all(o == CONTRADICTED for o in decided):
        return CONTRADICTED
    return PARTLY


def _strict_order(stats: dict[str, Stat]) -> list[list[str]]:
    """Frameworks from most to least, adjacent ones whose intervals touch joined in one tied group."""
    ordered = sorted(stats, key=lambda f: stats[f].median, reverse=True)
    groups: list[list[str]] = []
    for framework in ordered:
        if groups and tied(stats[groups[-1][-1]], stats[framework]):
            groups[-1].append(framework)
        else:
            groups.append([framework])
    return groups


def memory_order(stage: str) -> Callable[[Rows, Records, Cells], tuple[str, str]]:
    def check(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
        # the claims' setting is full fine-tuning (LoRA is plan A's lever, A17): LoRA cells are not evidence
        sets = matched_sets([r for r in rows if not r.get("lora")], cells, "framework", stage)
        if not sets:
            return NOT_MEASURED, (f"needs ok full fine-tuning (lora=0) {stage} runs of two or more frameworks at one "
                                  "configuration")
        outcomes, parts = [], []
        for matched in sets:
            # the claim orders the three frameworks it names (TRL and the reference are not in it)
            stats = {f: s for f, s in matched.stats("growth_bytes").items() if f in CLAIMED_MEMORY_ORDER}
            if len(stats) < 2:
                continue
            groups = _strict_order(stats)
            claimed = [f for f in CLAIMED_MEMORY_ORDER if f in stats]
            # each claimed pair (a above b): held beyond the spread, reversed beyond it, or tied
            pairs = {(a, b): "tied" if tied(stats[a], stats[b]) else
                     "holds" if stats[a].median > stats[b].median else "reversed"
                     for a, b in combinations(claimed, 2)}
            said = set(pairs.values())
            if min(s.n for s in stats.values()) < MIN_REPEATS:
                outcomes.append(UNDECIDED)
            elif said == {"holds"}:
                outcomes.append(SUPPORTED)
            elif "holds" in said:
                outcomes.append(PARTLY)  # some pairs as claimed, the others tied or reversed
            elif "reversed" in said:
                outcomes.append(CONTRADICTED)
            else:
                outcomes.append(TIE)
            order = " > ".join("=".join(g) for g in groups)
            pair_text = ", ".join(f"{a} > {b} {said_}" for (a, b), said_ in pairs.items())
            parts.append(f"{describe(matched, 'growth_bytes', MIB, ' MiB', 0)} -> {order}: {pair_text} "
                         f"({outcomes[-1]})")
        return _combine(outcomes), (f"memory growth over the post-import baseline (max over ranks and the phases "
                                    "after imports), "
                                    f"matched sets: {'; '.join(parts)}; claimed order "
                                    f"{' > '.join(CLAIMED_MEMORY_ORDER)}; '=' joins intervals that overlap"
                                    + _scale_note(rows))
    return check


def lora_support(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    """A4 names support levels (trlx complete, DS-Chat partial, ColossalAI experimental). Measured: which stages
    each framework's LoRA runs finish, and what its LoRA leaves training (trainable / all parameters of the
    trained models, read from the built models): DS-Chat wraps only the blocks' linear weights of the actor and
    keeps embeddings, norms, biases and the whole critic trainable. Every framework running every stage
    contradicts "partial" and "experimental" as support levels; where one framework's LoRA still trains far
    more of its models (over twice the others' share), its LoRA is partial in what it freezes: partly supported."""
    lora = [r for r in rows if r["lora"] and not is_forced_failure(r) and not r.get("refused")]
    if not lora:
        return NOT_MEASURED, "no LoRA runs"
    parts, complete, shares = [], [], {}
    for framework in sorted({r["framework"] for r in lora}):
        runs = [r for r in lora if r["framework"] == framework]
        ok = [r for r in runs if r["status"] == "ok"]
        stages = sorted({r["stage"] for r in ok})
        trained = [(r["trainable_params"], r["trained_params"]) for r in ok
                   if r["stage"] == "ppo" and r.get("trainable_params") and r.get("trained_params")]
        share = ""
        if trained:
            trainable, total = min(trained)
            shares[framework] = trainable / total
            share = (f"; in PPO its LoRA leaves {trainable / 1e6:,.2f} M of {total / 1e6:,.2f} M parameters of the "
                     f"trained models training ({shares[framework]:.1%})")
        parts.append(f"{framework}: {len(ok)}/{len(runs)} LoRA stage runs ok ({', '.join(stages) or 'none'}){share}")
        complete.append(len(ok) == len(runs) and set(stages) >= {"sft", "rm", "ppo"})
    note = ("DS-Chat's --actor_lora_dim wraps the actor's block linear weights only: embeddings, norms, biases "
            "and the whole critic stay trainable")
    heavy = [f for f, v in shares.items() if len(shares) > 1 and all(v > 2 * o for g, o in shares.items() if g != f)]
    if all(complete) and len(complete) > 1:
        if heavy:
            return PARTLY, (f"every framework runs LoRA through SFT, RM and PPO (against 'partial' and 'experimental' "
                            f"as support levels), but {', '.join(heavy)}'s LoRA trains over twice the others' share "
                            f"of parameters ({note}): " + "; ".join(parts))
        return CONTRADICTED, f"every framework ran LoRA through SFT, RM and PPO ({note}): " + "; ".join(parts)
    return PARTLY if any(complete) else NOT_MEASURED, "; ".join(parts) + f" ({note})"


def _unstable_share(runs: Rows) -> float:
    judged = [r for r in runs if r.get("stability")]
    return sum(r["stability"] not in ("stable", "recovered") for r in judged) / len(judged) if judged else 0.0


def precision_stability(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    """Each part compares frameworks in matched sets at one precision (forced failures never count): 'risky'
    means a larger unstable share than every other framework there, 'best' a strictly smaller one (a tie is
    not best), 'stable' no unstable run."""
    judged = [r for r in rows if not is_forced_failure(r) and r.get("stability")]
    sets = [m for m in matched_sets([dict(r, status="ok") for r in judged], cells, "framework")]
    checks: list[tuple[str | None, str]] = []
    for framework, precision, wants in (("dschat", "fp16", "riskier"), ("colossalai", "bf16", "stable"),
                                        ("trlx", "bf16", "best")):
        results = []
        for matched in sets:
            if framework not in matched.by_value or matched.by_value[framework][0]["precision"] != precision:
                continue
            mine = _unstable_share(matched.by_value[framework])
            others = [_unstable_share(v) for f, v in matched.by_value.items() if f != framework]
            # a share of one or two runs says nothing of a rate: "stable" reads the framework's own runs, the
            # comparisons every framework's in the set
            compared = [matched.by_value[framework]] if wants == "stable" else list(matched.by_value.values())
            if min(len(v) for v in compared) < MIN_REPEATS:
                outcome = UNDECIDED
            elif wants == "riskier":
                outcome = SUPPORTED if mine > max(others) else TIE if mine == max(others) else CONTRADICTED
            elif wants == "best":
                outcome = SUPPORTED if mine < min(others) else TIE if mine == min(others) else CONTRADICTED
            else:
                outcome = SUPPORTED if mine == 0 else CONTRADICTED
            results.append(outcome)
            checks.append((outcome, f"{framework} {precision} ({wants}) [{matched.fixed}]: unstable share "
                                    f"{mine:.0%} vs others {', '.join(f'{o:.0%}' for o in others)} -> {outcome}"))
        if not results:
            checks.append((None, f"{framework} {precision} against another framework at one configuration: "
                                 "not measured"))
    measured = [o for o, _ in checks if o is not None]
    text = "; ".join(t for _, t in checks) + _scale_note(rows)
    return (_combine(measured) if measured else NOT_MEASURED), text


CLAIMED_ZERO3_RANGE = (1.15, 1.20)  # A7: ZeRO-3 / ZeRO-2 peak


def zero3_vs_zero2(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    """A7, PPO cells that differ only in the ZeRO stage: supported where ZeRO-3's peak is above ZeRO-2's beyond
    the spread and the ratio lies in the claimed 1.15-1.20 at every pairing of the seeds' extremes; partly where
    it is above but the size is outside that range or not decided (the extremes' ratios straddle a bound);
    contradicted where it is below beyond the spread; a tie where the ranges touch."""
    outcomes, parts = [], []
    low, high = CLAIMED_ZERO3_RANGE
    for matched in matched_sets(rows, cells, "zero", "ppo"):
        stats = matched.stats("peak_bytes")
        if 2 not in stats or 3 not in stats:
            continue
        ratio = stats[3].median / stats[2].median
        side = compare(stats[3], stats[2])
        # the size is decided only where every pairing of the seeds' extremes gives a ratio on one side of the
        # claimed range's bounds: ZeRO-3's lowest over ZeRO-2's highest up to ZeRO-3's highest over ZeRO-2's lowest
        least, most = stats[3].low / stats[2].high, stats[3].high / stats[2].low
        if side in (FEW, TIE_, LOWER):
            outcome, size = {FEW: UNDECIDED, TIE_: TIE, LOWER: CONTRADICTED}[side], ""
        elif low <= least and most <= high:
            outcome, size = SUPPORTED, "direction and size supported"
        elif most < low or least > high:
            outcome, size = PARTLY, "direction supported, size outside the claim"
        else:
            outcome, size = PARTLY, "direction supported, size not decided"
        outcomes.append(outcome)
        parts.append(f"{describe(matched, 'peak_bytes', MIB, ' MiB', 0)}: ZeRO-3 / ZeRO-2 peak = {ratio:.3f} "
                     f"(seed extremes {least:.3f}-{most:.3f}) against the claimed {low:.2f}-{high:.2f} ("
                     + (f"{size}: " if size else "") + f"{outcome})")
    if not outcomes:
        return NOT_MEASURED, "needs ok PPO runs at zero=2 and zero=3 of one configuration"
    return _combine(outcomes), "; ".join(parts) + _scale_note(rows)


def lora_rank_cost(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    outcomes, parts = [], []
    for matched in matched_sets(rows, cells, "lora"):
        stats = matched.stats("growth_bytes")
        if 0 not in stats:
            continue
        for rank in [r for r in stats if r >= 64]:
            ratio = stats[rank].median / stats[0].median
            outcome = {FEW: UNDECIDED, TIE_: TIE, HIGHER: SUPPORTED, LOWER: CONTRADICTED}[
                compare(stats[rank], stats[0])]
            outcomes.append(outcome)
            parts.append(f"{describe(matched, 'growth_bytes', MIB, ' MiB', 0)}: LoRA {rank} / full = {ratio:.3f} "
                         f"({outcome})")
    if not outcomes:
        return NOT_MEASURED, "needs ok runs at lora >= 64 and lora = 0 of one configuration"
    return _combine(outcomes), "; ".join(parts) + _scale_note(rows)


def trlx_grad_ckpt(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    outcomes, parts = [], []
    for matched in matched_sets([r for r in rows if r["framework"] == "trlx"], cells, "grad_ckpt", "ppo"):
        stats = matched.stats("step_time_s")
        ratio = stats[True].median / stats[False].median
        side = compare(stats[True], stats[False])
        outcome = {FEW: UNDECIDED, TIE_: TIE, LOWER: CONTRADICTED}.get(
            side, SUPPORTED if 2.0 <= ratio <= 4.0 else PARTLY)
        outcomes.append(outcome)
        parts.append(f"{describe(matched, 'step_time_s', 1.0, ' s', 2)}: with / without = {ratio:.2f}x, claimed 3x "
                     f"(2-4x counts as it) ({outcome})")
    if not outcomes:
        return NOT_MEASURED, "needs ok trlx PPO runs with grad_ckpt=true and false at one configuration (gradient " \
                             "checkpointing is a harness extension for trlx)"
    return _combine(outcomes), "; ".join(parts) + " (claim: 3x)"


def trlx_fp16_nan(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    runs = [r for r in rows if r["framework"] == "trlx" and r["stage"] == "ppo" and r["precision"] == "fp16"
            and not is_forced_failure(r)]
    if not runs:
        return NOT_MEASURED, "no trlx fp16 PPO runs (forced failures do not count)"
    nan = [r for r in runs if r["status"] == "nan" or r.get("stability") == "diverged"]
    steps = max(len(records[r["run"]]["stages"]["ppo"].get("steps") or []) for r in runs)
    if nan:
        return SUPPORTED, f"{len(nan)}/{len(runs)} trlx fp16 PPO runs went non-finite"
    if steps < 50:
        return NOT_MEASURABLE, f"no non-finite value in {len(runs)} runs of at most {steps} steps; the claim is " \
                               "about ~50 steps on GLM-10B"
    return CONTRADICTED, f"{len(runs)} trlx fp16 PPO runs of up to {steps} steps stayed finite"


def _evidence_records(records: Records) -> Records:
    return {run: r for run, r in records.items() if FORCED_FAILURE not in tags_of(r["config"])}


def four_models(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    roles: dict[str, set[str]] = {}
    trained: dict[str, int] = {}
    for record in _evidence_records(records).values():
        ppo = record["stages"].get("ppo") or {}
        state = {k: v for k, v in (ppo.get("model_state") or {}).items() if k != "method"}
        if ppo.get("status") == "ok" and state:
            framework = record["config"]["framework"]["name"]
            roles.setdefault(framework, set()).update(state)
            trained[framework] = max(trained.get(framework, 0), sum(
                1 for v in state.values() if any(v.get("optimizer_state_bytes_per_rank") or [])))
    if not roles:
        return NOT_MEASURED, "no ok PPO runs"
    parts = [f"{f}: models with state {sorted(r)}, {trained[f]} with optimizer state" for f, r in sorted(roles.items())]
    four = [len(r) == 4 for r in roles.values()]
    verdict = SUPPORTED if all(four) else CONTRADICTED if not any(four) else PARTLY
    return verdict, "; ".join(parts)


def optimizer_vs_weights(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    ratios: dict[tuple[str, str], list[float]] = {}
    for record in _evidence_records(records).values():
        for stage in record["stages"].values():
            actor = (stage.get("model_state") or {}).get("actor") or {}
            params = (actor.get("trainable_param_bytes_per_rank") or [None])[0]
            optim = (actor.get("optimizer_state_bytes_per_rank") or [None])[0]
            if stage.get("status") == "ok" and params and optim and record["config"].get("zero") == 0:
                key = (record["config"]["framework"]["name"], record["config"]["precision"])
                ratios.setdefault(key, []).append(optim / params)
    if not ratios:
        return NOT_MEASURED, "needs ok runs at zero=0 (unsharded optimizer state)"
    parts = {key: stat(v) for key, v in sorted(ratios.items())}
    more = [s.median > 2.0 for s in parts.values()]
    verdict = SUPPORTED if all(more) else CONTRADICTED if not any(more) else PARTLY
    return verdict, "optimizer-state bytes / trainable weight bytes of the actor, zero=0: " + ", ".join(
        f"{f} {p} {s.median:.2f}x" for (f, p), s in parts.items()) + " (Adam keeps 2 fp32 moments: 2x of fp32 " \
        "weights; an engine that trains 16-bit weights adds an fp32 master copy: 6x; autocast keeps fp32 weights: 2x)"


CURVE_STEPS = 100  # B10's accuracy half reads reward and KL curves at least this long (issue: >= 100 steps)


def int8_frozen_roles(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    """B10, from PPO cells that differ only in reference.quant / reward.quant (quantized against none), each
    quantized cell judged against `none` when both have MIN_REPEATS runs (else not decided). Memory: on a
    GLM-ladder model (not the tiny test model), the quantized cell's growth below the unquantized one's beyond the
    repeats' spread both in the experience phase (where the frozen models run) and at the run's peak (what a user
    budgets for). Accuracy: over at least CURVE_STEPS steps, the final reward and KL (mean of the last steps) of the
    two cells overlapping over their repeats. Supported when both hold in every set, contradicted when neither does
    anywhere; the probe batch's deviations are stated per quantized cell."""
    memory, accuracy, parts = [], [], []
    for matched in matched_sets(rows, cells, "quant", "ppo"):
        if "none" not in matched.by_value:
            continue
        growth, peak, reward, kl = (matched.stats(c) for c in ("growth_experience_bytes", "growth_bytes",
                                                               "reward_end", "kl_end"))
        texts = [describe(matched, "growth_experience_bytes", MIB, " MiB", 0) + " experience growth",
                 "peak growth " + ", ".join(f"{v}: {peak[v].fmt(MIB, 0)} MiB" for v in matched.by_value)]
        for value in [v for v in matched.by_value if v != "none"]:
            runs = matched.by_value[value]
            text = []
            if min(len(runs), len(matched.by_value["none"])) < MIN_REPEATS:
                text.append(f"not decided (n={len(runs)} against {len(matched.by_value['none'])}; "
                            f"{MIN_REPEATS} a side)")
            else:
                if runs[0]["model"] != "tiny":
                    sides = {name: (not tied(stat_["none"], stat_[value]),
                                    stat_[value].median < stat_["none"].median)
                             for name, stat_ in (("experience", growth), ("peak", peak))}
                    memory.append(SUPPORTED if all(apart and lower for apart, lower in sides.values()) else
                                  CONTRADICTED if any(apart and not lower for apart, lower in sides.values()) else TIE)
                    text.append("; ".join(f"{name} growth " + ("within the spread" if not apart else
                                                              "lower" if lower else "higher")
                                          for name, (apart, lower) in sides.items()))
                steps = min(r.get("timed_steps") or 0 for rows_ in matched.by_value.values() for r in rows_)
                if steps >= CURVE_STEPS:
                    same = tied(reward["none"], reward[value]) and tied(kl["none"], kl[value])
                    accuracy.append(SUPPORTED if same else CONTRADICTED)
                    text.append(f"final reward {reward['none'].fmt(1.0, 3)} vs {reward[value].fmt(1.0, 3)}, KL "
                                f"{kl['none'].fmt(1.0, 4)} vs {kl[value].fmt(1.0, 4)} over {steps}+ timed steps ("
                                + ("within the spread" if same else "apart") + ")")
            deviations = "; ".join(
                f"{role} {_median(runs, f'{role}_quant_deviation'):.3g} (mean |value| "
                f"{_median(runs, f'{role}_quant_scale'):.3g}), {_median(runs, f'{role}_quant_saved_bytes') / MIB:,.1f}"
                f" MiB of weights saved" for role in ("ref", "reward")
                if _median(runs, f"{role}_quant_deviation") is not None)
            text.append(f"deviation on the probe batch: {deviations or 'not recorded'}")
            texts.append(f"{value} against none: " + ", ".join(text))
        parts.append("; ".join(texts))
    if not memory and not accuracy:
        return NOT_MEASURED, ("needs ok PPO runs with reference.quant and reward.quant int8 and none at one "
                              f"configuration, {MIN_REPEATS} repeats a side: on a GLM-ladder model for the memory, "
                              f"over at least {CURVE_STEPS} steps for the accuracy (scripts/glm_sweep.sh, blocks Q and "
                              "K)")
    # each half's verdict over its sets; with one half unmeasured the claim is at most partly supported
    mem, acc = (_combine(o) if o else None for o in (memory, accuracy))
    halves = [f"memory (experience and peak growth lower): {mem}" if mem
              else "memory not decided on a GLM-ladder model",
              f"accuracy (final reward and KL within the spread): {acc}" if acc
              else f"accuracy not measured over {CURVE_STEPS}+ steps"]
    verdict = _combine([mem, acc]) if mem and acc else PARTLY if (mem or acc) == SUPPORTED else (mem or acc)
    return verdict, f"{'; '.join(halves)}. " + " | ".join(parts) + _scale_note(rows)


CLAIMED_BUCKET = 500_000_000  # A14: allgather_bucket_size = 5e8 cuts communication by 20 %


def allgather_bucket(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    """A14, from cells that differ only in ds.allgather_bucket_size, 5e8 against each smaller value: the
    training phase's time per step (DeepSpeed exposes no communication time on these engines, so the whole
    phase is compared; a 20 % cut of its communication shows as less). Per pair: supported where 5e8's time
    is lower beyond the repeats' spread, contradicted where it is higher beyond it, a tie where the ranges
    touch; the verdict is the pairs' common one."""
    outcomes, parts = [], []
    for matched in matched_sets(rows, cells, "allgather_bucket"):
        runs = matched.by_value
        if CLAIMED_BUCKET not in runs:
            continue
        times = matched.stats("time_s_per_step_training")
        claimed = times[CLAIMED_BUCKET]
        for value in sorted(v for v in runs if isinstance(v, int) and v < CLAIMED_BUCKET):
            other = times[value]
            if claimed.median is None or other.median is None:
                continue
            side = compare(claimed, other)
            outcomes.append({FEW: UNDECIDED, TIE_: TIE, LOWER: SUPPORTED, HIGHER: CONTRADICTED}[side])
            words = {FEW: f"fewer than {MIN_REPEATS} repeats a side", TIE_: "ranges touch",
                     LOWER: "lower beyond the spread", HIGHER: "higher beyond the spread"}[side]
            parts.append(f"[{matched.fixed}] training step {claimed.fmt(1.0, 2)} s at 5e8 vs {other.fmt(1.0, 2)} s "
                         f"at {value:.0e} ({(1 - claimed.median / other.median) * 100:+.1f} % less time with 5e8): "
                         f"{words} ({outcomes[-1]})")
    if not outcomes:
        return NOT_MEASURED, ("needs ok runs with ds.allgather_bucket_size 5e8 and a smaller value at one "
                              "configuration (scripts/glm_sweep.sh, block G)")
    return _combine(outcomes), "; ".join(parts) + _scale_note(rows)


CLAIMED_SPEEDUP = 0.4  # A13: z-score normalisation converges in 40 % fewer steps
MIN_SEEDS = MIN_REPEATS  # A13: repeats per cell


def zscore_convergence(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    """A13, from PPO cells that differ only in reward.normalize (zscore against none), each with at least
    MIN_SEEDS repeats: the steps until the preferred-token share covers 90 % of its rise (converged_step; a
    run whose share never rose counts as its whole length, not converged). Per set: supported where zscore's
    median is at most 60 % of none's and the repeats' ranges do not touch, partly where it is faster beyond
    the spread by less, contradicted where it is slower beyond the spread, a tie where the ranges touch; the
    verdict is the sets' common outcome, else partly."""
    outcomes, parts = [], []
    for matched in matched_sets(rows, cells, "normalize", "ppo"):
        runs = matched.by_value
        if not {"zscore", "none"} <= set(runs) or min(len(runs["zscore"]), len(runs["none"])) < MIN_SEEDS:
            continue
        steps = {value: stat([r["converged_step"] if r.get("converged_step") is not None else r.get("timed_steps")
                              for r in runs[value]]) for value in ("zscore", "none")}
        z, n = steps["zscore"], steps["none"]
        if z.median is None or n.median is None:
            continue
        side = compare(z, n)
        outcome = {FEW: UNDECIDED, TIE_: TIE, HIGHER: CONTRADICTED}.get(
            side, SUPPORTED if z.median <= (1 - CLAIMED_SPEEDUP) * n.median else PARTLY)
        outcomes.append(outcome)
        never = {v: sum(r.get("converged_step") is None for r in runs[v]) for v in ("zscore", "none")}
        share = matched.stats("preferred_fraction_end")
        fewer = (1 - z.median / n.median) * 100 if n.median else 0.0
        parts.append(
            f"[{matched.fixed}] steps to 90 % of the preferred-share rise: zscore {z.fmt(1.0, 0)}, none "
            f"{n.fmt(1.0, 0)} ({fewer:+.0f} % fewer with zscore; never rose: {never['zscore']} of "
            f"{len(runs['zscore'])} zscore, {never['none']} of {len(runs['none'])} none runs); final preferred "
            f"share {share['zscore'].fmt(1.0, 3)} vs {share['none'].fmt(1.0, 3)}: {outcome}")
    if not outcomes:
        return NOT_MEASURED, (f"needs ok PPO runs with reward.normalize zscore and none at one configuration, "
                              f"{MIN_SEEDS}+ seeds each (scripts/glm_sweep.sh, block N)")
    return _combine(outcomes), "; ".join(parts) + _scale_note(rows)


# A15's quality figure per stage: (column, higher is better, in words)
LORA_QUALITY = {"sft": ("loss_end_mean", False, "final training loss"), "rm": ("accuracy_end", True, "held-out "
                "accuracy"), "ppo": ("preferred_fraction_end", True, "final preferred-token share")}
PRACTICE_RANKS = range(8, 33)  # A15: rank 8-32


def _learns(matched, column: str, higher: bool, claimed: Any, other: Any) -> str:
    """How the claimed setting learns against the other: "as well" (ranges touch: a tie), "better" or "worse"."""
    stats = matched.stats(column)
    a, b = stats[claimed], stats[other]
    if tied(a, b):
        return "as well"
    return "better" if (a.median > b.median if higher else a.median < b.median) else "worse"


def lora_practice(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    """A15, from cells at a LoRA rank of 8-32 that differ only in lora_targets (qkv against each other set) or
    only in lora_alpha (rank / 2 against each other value, null = the framework's default), on each stage's
    quality figure (LORA_QUALITY). Targets: supported where q/k/v alone learns as well (ranges touch) or better
    with no more trainable parameters, contradicted where it learns worse beyond the spread or trains more
    (DS-Chat freezes only the weights it wraps). Alpha: supported where rank / 2 learns as well. A pair whose
    engines applied the same alpha (coati's linear layers keep 32) is shown, not counted. The rank range itself
    is not compared here (A8 compares the memory of ranks >= 64)."""
    outcomes, parts = [], []
    for stage, (column, higher, words) in LORA_QUALITY.items():
        for matched in matched_sets(rows, cells, "lora_targets", stage):
            first = next(iter(matched.by_value.values()))[0]
            if "qkv" not in matched.by_value or first["lora"] not in PRACTICE_RANKS:
                continue
            quality, trained = matched.stats(column), matched.stats("trainable_params")
            for other in [v for v in matched.by_value if v != "qkv"]:
                if quality["qkv"].median is None or quality[other].median is None:
                    continue
                learns = _learns(matched, column, higher, "qkv", other)
                more = (trained["qkv"].median or 0) > (trained[other].median or 0)
                outcomes.append(SUPPORTED if learns != "worse" and not more else CONTRADICTED)
                layers = {v: runs[0].get("lora_layers") for v, runs in matched.by_value.items()}
                parts.append(
                    f"[{stage} {matched.fixed}] targets qkv vs {other} (adapted: {layers['qkv']} vs "
                    f"{layers[other]}): {words} {quality['qkv'].fmt(1.0, 3)} vs {quality[other].fmt(1.0, 3)}, "
                    f"trainable parameters {trained['qkv'].fmt(1.0, 0)} vs {trained[other].fmt(1.0, 0)}: "
                    + f"learns {learns}" + (", trains more" if more else "")
                    + f" ({outcomes[-1]})")
        for matched in matched_sets(rows, cells, "lora_alpha", stage):
            rank = next(iter(matched.by_value.values()))[0]["lora"]
            if rank not in PRACTICE_RANKS or rank / 2 not in matched.by_value:
                continue
            quality, applied = matched.stats(column), matched.stats("lora_alpha_applied")
            for other in [v for v in matched.by_value if v != rank / 2]:
                if quality[rank / 2].median is None or quality[other].median is None:
                    continue
                name = "the default" if other is None else f"{other:g}"
                text = (f"[{stage} {matched.fixed}] alpha {rank / 2:g} vs {name} (applied "
                        f"{applied[rank / 2].fmt(1.0, 1)} vs {applied[other].fmt(1.0, 1)}): {words} "
                        f"{quality[rank / 2].fmt(1.0, 3)} vs {quality[other].fmt(1.0, 3)}")
                if applied[rank / 2].median == applied[other].median:
                    parts.append(text + " (the engines applied one alpha to both: not counted)")
                    continue
                learns = _learns(matched, column, higher, rank / 2, other)
                outcomes.append(SUPPORTED if learns != "worse" else CONTRADICTED)
                parts.append(text + f": learns {learns} ({outcomes[-1]})")
    if not outcomes:
        return NOT_MEASURED, ("needs ok runs at a LoRA rank of 8-32 that differ only in lora_targets (qkv and "
                              "another set) or in lora_alpha (rank / 2 and another value) (scripts/glm_sweep.sh, "
                              "block L)" + ("; " + "; ".join(parts) if parts else ""))
    return _combine(outcomes), "; ".join(parts) + _scale_note(rows)


def _median(runs: Rows, column: str) -> float | None:
    return stat([r.get(column) for r in runs]).median


def _unmeasurable(reason: str) -> Callable[[Rows, Records, Cells], tuple[str, str]]:
    return lambda rows, records, cells: (NOT_MEASURABLE, reason)


GPU_ONLY = "needs the GPU cluster it describes"
# The settings the articles state (conf/claims.yaml): GLM-10B on 8 x A100 at ZeRO-2, batch 4, sequence 512;
# plan B's "8B model" on 8 nodes x 8 GPUs x 40 GB, read as a GLM-shaped 8 B model (h 4096, 40 layers).
_GLM10B = plan_file.arch_of("glm-10b")[1]
_EIGHT_B = Arch(hidden=4096, layers=40, heads=32, vocab=50304, positions=1024)
_A = arithmetic.Setting(_GLM10B, "sft", gpus=8, zero=2, micro_batch=4, seq=512)


def _figures(stage: str, figures: dict[str, float]) -> Callable[[Rows, Records, Cells], tuple[str, str]]:
    return lambda rows, records, cells: arithmetic.memory_figures(replace(_A, stage=stage), figures)


def _plan_a(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    """A17 as stated: LoRA 16, ZeRO-2, optimizer offload, batch 16, 8 x V100-32G, sequence 512 (setting A)."""
    setting = replace(_A, stage="ppo", lora=16, offload=True, micro_batch=16, precision="fp16")
    return arithmetic.memory_figures(setting, {"plan A per V100": 32.0})


def _a20(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    batch_verdict, batch_text = arithmetic.batch_arithmetic(32, 4, 4, 8)
    mem_verdict, mem_text = arithmetic.fits_device(replace(_A, stage="ppo", offload=True), "A100-80GB")
    verdict = arithmetic.IMPLAUSIBLE if arithmetic.IMPLAUSIBLE in (batch_verdict, mem_verdict) else batch_verdict
    return verdict, f"batch: {batch_text} ({batch_verdict}); memory: {mem_text} ({mem_verdict})"


def _a18(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    verdict, text = arithmetic.batch_arithmetic(256, 4, 8, 8)
    return verdict, f"with setting A's batch 4 on 8 A100s: {text}"


def _b2(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    weights = _EIGHT_B.total_params * 2
    setting = arithmetic.Setting(_EIGHT_B, "ppo", gpus=8, zero=2, micro_batch=1, seq=1024)
    fits, text = arithmetic.fits_device(setting, "A100-40GB")
    # the claim says they do not fit: it holds when the arithmetic says they do not
    verdict = arithmetic.CONSISTENT if fits == arithmetic.IMPLAUSIBLE else arithmetic.IMPLAUSIBLE
    return verdict, (f"an 8 B GLM-shaped model ({_EIGHT_B.total_params / 1e9:.2f} B parameters) has "
                     f"{weights / 1e9:.1f} GB of 16-bit weights; one node of 8 x 40 GB at ZeRO-2: {text}")


def _b5(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    from bench.plan.cluster import Cluster, Layout, Workload
    from bench.plan.search import evaluate, make_roles

    cluster = Cluster(nodes=8, gpus_per_node=8, gpu="A100-40GB")
    layouts = {"actor": Layout(8, 1, 4, 2), "reference": Layout(8, 1, 4), "reward": Layout(4, 1, 8),
               "critic": Layout(8, 1, 4, 2)}
    groups = (("actor", "reference", "critic"), ("reward",))
    workload = Workload(micro_batch=1, prompt_len=512, answer_len=512)
    plan = evaluate("B5", make_roles(_EIGHT_B, workload), layouts, groups, workload, cluster)
    dp = cluster.gpus // 8
    memory = (f"fits: peak {plan.peak / 2**30:.1f} GiB per GPU of {plan.limit / 2**30:.1f} usable" if plan.fits
              else "does not fit: " + "; ".join(plan.overflows()))
    verdict = arithmetic.CONSISTENT if plan.fits else arithmetic.IMPLAUSIBLE
    return verdict, (f"each layout spans 32 GPUs (tp x pp x dp), so the plan uses 64 only with actor, reference and "
                     f"critic on one half and the reward on the other (with B4's DP = GPUs / (TP x PP) over all 64, "
                     f"tp8 would give dp {dp}); on those halves, at ZeRO-2 for actor and critic, micro-batch 1 of "
                     f"512 + 512 tokens, the memory model says it {memory}")


def _dtype_a100(rows: Rows, records: Records, cells: Cells) -> tuple[str, str]:
    verdict, text = arithmetic.dtype_support("A100-40GB", "bf16")
    _, v100 = arithmetic.dtype_support("V100-32GB", "bf16")
    return verdict, f"{text}; (plan A's V100s would not: {v100})"


# each claim of conf/claims.yaml (its statement is read from there, bench.report.claims_data) with its check
CHECKS: tuple[tuple[str, Callable[[Rows, Records, Cells], tuple[str, str]]], ...] = (
    ("A1", memory_order("sft")),
    ("A2", memory_order("rm")),
    ("A3", memory_order("ppo")),
    ("A1 figures", _figures("sft", {"Trlx": 38.2, "ColossalAI": 26.8, "DeepSpeed-Chat": 22.4})),
    ("A2 figures", _figures("rm", {"Trlx": 42.7, "ColossalAI": 31.4, "DeepSpeed-Chat": 25.1})),
    ("A3 figures", _figures("ppo", {"Trlx": 45.3, "ColossalAI": 34.2, "DeepSpeed-Chat": 28.9})),
    ("A5 dtype", _dtype_a100),
    ("A4", lora_support),
    ("A5", precision_stability),
    ("A6", _unmeasurable("the Hybrid Engine's fused inference kernels and memory reuse exist on CUDA only")),
    ("A7", zero3_vs_zero2),
    ("A8", lora_rank_cost),
    ("A9", trlx_grad_ckpt),
    ("A10", trlx_fp16_nan),
    ("A11", _unmeasurable("the Hybrid Engine's FP16 path runs on CUDA only")),
    ("A12", _unmeasurable("a tuning claim about GLM-10B on GPUs; the harness records loss scales but sets none by "
                          "hand")),
    ("A13", zscore_convergence),
    ("A14", allgather_bucket),
    ("A15", lora_practice),
    ("A16", _unmeasurable(GPU_ONLY)),
    ("A17", _plan_a),
    ("A18", _a18),
    ("A19", _unmeasurable("model size beyond the sweep, development speed and customisation are not measured; see "
                          "the measured decision tree above")),
    ("A20", _a20),
    ("B1", four_models),
    ("B2", _b2),
    ("B3", optimizer_vs_weights),
    ("B4", _unmeasurable("a planning rule for multi-node GPU clusters")),
    ("B5", _b5),
    ("B6", _unmeasurable("advice, not a measured quantity")),
    ("B7", _unmeasurable("needs device capacity; host RSS on the CPU has none to compare with")),
    ("B8", _unmeasurable(GPU_ONLY)),
    ("B9", _unmeasurable("needs runs of ~1,000 steps on a GPU allocator")),
    ("B10", int8_frozen_roles),
    ("B11", _unmeasurable("advice, not a measured quantity")),
    ("B12", _unmeasurable("advice, not a measured quantity")),
)


def check_all(rows: Rows, records: Records, cells: Cells) -> list[Verdict]:
    """The claims are about the frameworks: the plain-PyTorch reference is never evidence for or against one.
    A verdict read from measurements says how many cells of mixed provenance it had to leave out."""
    rows = [r for r in rows if r["framework"] != YARDSTICK]
    refused = {r["cell"] for r in rows if r.get("refused")}
    note = (f" [{len(refused)} cell(s) of mixed provenance left out: runs at different commits, dirty states, "
            "hosts, versions or measurement settings; --allow-mixed-provenance counts them]") if refused else ""
    out = []
    stated = claims_data.statements()
    if set(stated) != {claim_id for claim_id, _ in CHECKS}:
        raise ValueError(f"conf/claims.yaml and the checks disagree: {sorted(set(stated) ^ {c for c, _ in CHECKS})}")
    for claim_id, check in CHECKS:
        claim = stated[claim_id]
        verdict, evidence = check(rows, records, cells)
        measured = verdict not in (NOT_MEASURABLE, arithmetic.IMPLAUSIBLE, arithmetic.CONSISTENT)
        out.append(Verdict(claim_id, claim, verdict, evidence + (note if measured else "")))
    return out


def caveat(rows: Rows, records: Records) -> str:
    """At what scale, on what machine, with how many repeats the verdicts were reached."""
    evidence = [r for r in rows if r["status"] == "ok" and not is_forced_failure(r)]
    if not evidence:
        return "No finished run that is evidence: every verdict above is 'not measured' or 'not measurable'."
    sizes = {}
    for r in evidence:
        params = ((records[r["run"]]["stages"][r["stage"]].get("params") or {}).get("actor") or {}).get("total")
        if params:  # the plain model is the smallest actor (no LoRA factors, value head or hydra branch)
            sizes[r["model"]] = min(params, sizes.get(r["model"], params))
    models = ", ".join(f"{m} ({sizes[m] / 1e6:,.1f} M parameters)" if m in sizes else m
                       for m in sorted({r["model"] for r in evidence}))
    hosts = sorted({r.get("host_type") or "unknown host" for r in evidence})
    devices = sorted({r.get("device") or "?" for r in evidence})
    machine = f"{'; '.join(hosts)} (device {', '.join(devices)})"
    repeats: dict[str, int] = {}
    for r in evidence:
        repeats[r["cell"]] = repeats.get(r["cell"], 0) + 1
    counts = sorted(repeats.values())
    steps = sorted(r.get("timed_steps") or 0 for r in evidence)
    ranks = sorted({r["nproc"] for r in evidence})
    return (f"These verdicts rest on {len(evidence)} finished runs in {len(repeats)} cells at the scale of {models}, "
            f"on {machine}, {', '.join(map(str, ranks))} rank(s); repeats per cell {counts[0]}-{counts[-1]} "
            f"(median {counts[len(counts) // 2]}), timed steps per run {steps[0]}-{steps[-1]}. Memory on a CPU is "
            "host RSS (no caching allocator, no device capacity), time on a CPU says little about GPU kernels, and "
            "the published claims are about GLM-10B on GPU clusters: a verdict here says how the frameworks' own "
            "structure behaves at this scale, not what GLM-10B will do. Runs tagged forced-failure are never "
            "evidence; only cells that differ in exactly the claim's knob are compared; a tie (overlapping "
            "intervals over repeats) never supports an ordering.")
