"""The claims check: the published claims of shared/reference/published-claims.md, each marked
supported / contradicted / not measurable at this scale / not measured in this sweep, with evidence.

Claims are measured as they are stated, on whatever the sweep ran; a verdict on the tiny CPU model
says so. Claims that need a GPU, GLM-10B itself, or a knob the harness does not have are marked not
measurable with the reason, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.report.aggregate import stat

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


def _scale_note(rows: Rows) -> str:
    models = sorted({r["model"] for r in rows})
    return f" (model {', '.join(models)}; memory method: host RSS on CPU)" if any(
        "RSS" in (r.get("memory_method") or "") for r in rows) else f" (model {', '.join(models)})"


def _peak_by_framework(rows: Rows, stage: str, **match: Any) -> dict[str, Any]:
    chosen = [r for r in rows if r["stage"] == stage and r["status"] == "ok"
              and all(r.get(k) == v for k, v in match.items())]
    return {f: stat([r["growth_bytes"] for r in chosen if r["framework"] == f]) for f in sorted(
        {r["framework"] for r in chosen})}


def memory_order(stage: str) -> Callable[[Rows, Records], tuple[str, str]]:
    def check(rows: Rows, records: Records) -> tuple[str, str]:
        # the articles' setting: ZeRO-2, batch 4; full fine-tuning where the sweep has it
        chosen = [r for r in rows if r["zero"] == 2]
        for key, value in (("batch", 4), ("lora", 0)):
            if any(r[key] == value and r["stage"] == stage and r["status"] == "ok" for r in chosen):
                chosen = [r for r in chosen if r[key] == value]
        peaks = _peak_by_framework(chosen, stage)
        if len(peaks) < 2:
            return NOT_MEASURED, f"needs ok {stage} runs at zero=2 from two or more frameworks; has {sorted(peaks)}"
        measured = sorted(peaks, key=lambda f: peaks[f].median, reverse=True)
        claimed = [f for f in CLAIMED_MEMORY_ORDER if f in peaks]
        figures = ", ".join(f"{f} {peaks[f].fmt(MIB, 0)} MiB" for f in measured)
        batches = sorted({r["batch"] for r in chosen if r["stage"] == stage})
        loras = sorted({r["lora"] for r in chosen if r["stage"] == stage})
        verdict = SUPPORTED if measured == claimed else CONTRADICTED
        return verdict, (f"median memory growth over the post-import baseline at zero=2, batch {batches}, "
                         f"lora {loras}, most to least: {figures}; claimed order {' > '.join(claimed)}"
                         + _scale_note(rows))
    return check


def lora_support(rows: Rows, records: Records) -> tuple[str, str]:
    lora = [r for r in rows if r["lora"]]
    if not lora:
        return NOT_MEASURED, "no LoRA runs"
    parts, complete = [], []
    for framework in sorted({r["framework"] for r in lora}):
        runs = [r for r in lora if r["framework"] == framework]
        ok = sum(r["status"] == "ok" for r in runs)
        stages = sorted({r["stage"] for r in runs if r["status"] == "ok"})
        parts.append(f"{framework}: {ok}/{len(runs)} LoRA stage runs ok ({', '.join(stages) or 'none'})")
        complete.append(ok == len(runs) and set(stages) >= {"sft", "rm", "ppo"})
    if all(complete) and len(complete) > 1:
        return CONTRADICTED, "every framework ran LoRA through SFT, RM and PPO: " + "; ".join(parts)
    return PARTLY if any(complete) else NOT_MEASURED, "; ".join(parts)


def precision_stability(rows: Rows, records: Records) -> tuple[str, str]:
    """Each part compares frameworks at one precision: 'risky' means less stable than the others there."""
    share: dict[tuple[str, str], tuple[int, int]] = {}
    for row in rows:
        if row.get("stability"):
            bad, total = share.get((row["framework"], row["precision"]), (0, 0))
            share[(row["framework"], row["precision"])] = (bad + (row["stability"] not in ("stable", "recovered")),
                                                           total + 1)

    def rate(framework: str, precision: str) -> float:
        bad, total = share[(framework, precision)]
        return bad / total

    def others(framework: str, precision: str) -> list[str]:
        return [f for f, p in share if p == precision and f != framework]

    checks: list[tuple[bool | None, str]] = []
    if ("dschat", "fp16") in share and others("dschat", "fp16"):
        worst_other = max(rate(f, "fp16") for f in others("dschat", "fp16"))
        checks.append((rate("dschat", "fp16") > worst_other, f"fp16 unstable share: dschat "
                       f"{rate('dschat', 'fp16'):.0%} vs others up to {worst_other:.0%} (claim: dschat riskier)"))
    else:
        checks.append((None, "dschat fp16 against another framework's fp16: not measured"))
    if ("colossalai", "bf16") in share:
        colossalai_bf16 = rate("colossalai", "bf16")
        checks.append((colossalai_bf16 == 0, f"colossalai bf16 unstable share {colossalai_bf16:.0%} (claim: stable)"))
    else:
        checks.append((None, "colossalai bf16: not measured"))
    if ("trlx", "bf16") in share and others("trlx", "bf16"):
        best_other = min(rate(f, "bf16") for f in others("trlx", "bf16"))
        checks.append((rate("trlx", "bf16") <= best_other, f"bf16 unstable share: trlx {rate('trlx', 'bf16'):.0%} "
                       f"vs others from {best_other:.0%} (claim: trlx best)"))
    else:
        checks.append((None, "trlx bf16 against another framework's bf16: not measured"))
    measured = [h for h, _ in checks if h is not None]
    text = "; ".join(t for _, t in checks) + _scale_note(rows)
    if not measured:
        return NOT_MEASURED, text
    verdict = SUPPORTED if all(measured) and len(measured) == 3 else CONTRADICTED if not any(measured) else PARTLY
    return verdict, text


def zero3_vs_zero2(rows: Rows, records: Records) -> tuple[str, str]:
    ratios = []
    for framework in sorted({r["framework"] for r in rows}):
        z2 = _peak_by_framework(rows, "ppo", zero=2).get(framework)
        z3 = _peak_by_framework(rows, "ppo", zero=3).get(framework)
        if z2 and z3 and z2.median and z3.median:
            ratios.append((framework, z3.median / z2.median))
    if not ratios:
        return NOT_MEASURED, "needs ok PPO runs at zero=2 and zero=3 of one framework"
    text = "; ".join(f"{f}: ZeRO-3 peak / ZeRO-2 peak = {r:.3f}" for f, r in ratios)
    if all(r >= 1.10 for _, r in ratios):
        verdict = SUPPORTED
    elif all(r <= 1.0 for _, r in ratios):
        verdict = CONTRADICTED
    else:  # more memory under ZeRO-3 somewhere, but not by the claimed margin everywhere
        verdict = PARTLY
    return verdict, text + " (claim: 1.15-1.20)" + _scale_note(rows)


def lora_rank_cost(rows: Rows, records: Records) -> tuple[str, str]:
    pairs = []
    for stage in ("sft", "rm", "ppo"):
        for framework in sorted({r["framework"] for r in rows}):
            full = _peak_by_framework(rows, stage, lora=0).get(framework)
            high = [r for r in rows if r["framework"] == framework and r["stage"] == stage and r["lora"] >= 64
                    and r["status"] == "ok"]
            if full and full.median and high:
                pairs.append((framework, stage, stat([r["growth_bytes"] for r in high]).median / full.median))
    if not pairs:
        return NOT_MEASURED, "needs ok runs at lora >= 64 and lora = 0 of one framework and stage"
    cancelled = [ratio >= 1.0 for *_, ratio in pairs]
    verdict = SUPPORTED if all(cancelled) else CONTRADICTED if not any(cancelled) else PARTLY
    ratios = "; ".join(f"{f} {s}: LoRA>=64 growth / full growth = {r:.3f}" for f, s, r in pairs)
    return verdict, ratios + _scale_note(rows)


def trlx_grad_ckpt(rows: Rows, records: Records) -> tuple[str, str]:
    ppo = [r for r in rows if r["framework"] == "trlx" and r["stage"] == "ppo" and r["status"] == "ok"]
    on = stat([r["step_time_s"] for r in ppo if r["grad_ckpt"]])
    off = stat([r["step_time_s"] for r in ppo if not r["grad_ckpt"]])
    if not on.n or not off.n:
        return NOT_MEASURED, "needs ok trlx PPO runs with grad_ckpt=true and false (gradient checkpointing is a " \
                             "harness extension for trlx)"
    ratio = on.median / off.median
    verdict = SUPPORTED if 2.0 <= ratio <= 4.0 else CONTRADICTED
    return verdict, f"trlx PPO step time with / without gradient checkpointing = {ratio:.2f}x (claim: 3x)"


def trlx_fp16_nan(rows: Rows, records: Records) -> tuple[str, str]:
    runs = [r for r in rows if r["framework"] == "trlx" and r["stage"] == "ppo" and r["precision"] == "fp16"]
    if not runs:
        return NOT_MEASURED, "no trlx fp16 PPO runs"
    nan = [r for r in runs if r["status"] == "nan" or r.get("stability") == "diverged"]
    steps = max(len(records[r["run"]]["stages"]["ppo"].get("steps") or []) for r in runs)
    if nan:
        return SUPPORTED, f"{len(nan)}/{len(runs)} trlx fp16 PPO runs went non-finite"
    if steps < 50:
        return NOT_MEASURABLE, f"no non-finite value in {len(runs)} runs of at most {steps} steps; the claim is " \
                               "about ~50 steps on GLM-10B"
    return CONTRADICTED, f"{len(runs)} trlx fp16 PPO runs of up to {steps} steps stayed finite"


def four_models(rows: Rows, records: Records) -> tuple[str, str]:
    roles: dict[str, set[str]] = {}
    trained: dict[str, int] = {}
    for record in records.values():
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


def optimizer_vs_weights(rows: Rows, records: Records) -> tuple[str, str]:
    ratios: dict[tuple[str, str], list[float]] = {}
    for record in records.values():
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


def _unmeasurable(reason: str) -> Callable[[Rows, Records], tuple[str, str]]:
    return lambda rows, records: (NOT_MEASURABLE, reason)


GPU_ONLY = "needs the GPU cluster it describes"
CLAIMS: tuple[tuple[str, str, Callable[[Rows, Records], tuple[str, str]]], ...] = (
    ("A1", "SFT peak memory: Trlx > ColossalAI > DeepSpeed-Chat (38.2 / 26.8 / 22.4 GB)", memory_order("sft")),
    ("A2", "RM peak memory: Trlx > ColossalAI > DeepSpeed-Chat (42.7 / 31.4 / 25.1 GB)", memory_order("rm")),
    ("A3", "PPO peak memory: Trlx > ColossalAI > DeepSpeed-Chat (45.3 / 34.2 / 28.9 GB)", memory_order("ppo")),
    ("A4", "LoRA: Trlx complete, DeepSpeed-Chat partial, ColossalAI experimental", lora_support),
    ("A5", "Trlx best in BF16; DeepSpeed-Chat FP16 risky; ColossalAI BF16 stable", precision_stability),
    ("A6", "DeepSpeed-Chat's memory advantage comes from its Hybrid Engine",
     _unmeasurable("the Hybrid Engine's fused inference kernels and memory reuse exist on CUDA only")),
    ("A7", "ZeRO-3 uses 15-20 % MORE memory than ZeRO-2 in PPO", zero3_vs_zero2),
    ("A8", "LoRA rank >= 64: adapter parameters cancel the memory savings", lora_rank_cost),
    ("A9", "Gradient checkpointing makes a Trlx PPO iteration 3x slower", trlx_grad_ckpt),
    ("A10", "Trlx FP16 on GLM: reward NaN after ~50 steps", trlx_fp16_nan),
    ("A11", "DeepSpeed-Chat Hybrid Engine FP16 needs gradient clipping 1e-4",
     _unmeasurable("the Hybrid Engine's FP16 path runs on CUDA only")),
    ("A12", "ColossalAI BF16 needs the loss scaler set to 1.0 by hand",
     _unmeasurable("a tuning claim about GLM-10B on GPUs; the harness records loss scales but sets none by hand")),
    ("A13", "z-score reward normalisation makes PPO converge 40 % faster",
     _unmeasurable("the harness has no reward-normalisation knob and tiny runs do not converge")),
    ("A14", "allgather_bucket_size = 5e8 cuts communication by 20 %", _unmeasurable(GPU_ONLY)),
    ("A15", "LoRA best practice: rank 8-32, q/k/v only, alpha = rank / 2",
     _unmeasurable("a recommendation about quality, not a measured quantity")),
    ("A16", "above 85 % GPU utilisation a larger batch still raises throughput", _unmeasurable(GPU_ONLY)),
    ("A17", "plan A: LoRA + ZeRO-2 + offload runs GLM-10B on 8 x V100-32G", _unmeasurable(GPU_ONLY)),
    ("A18", "plan B: gradient accumulation 8 reaches an effective batch of 256", _unmeasurable(GPU_ONLY)),
    ("A19", "decision tree: 30B+ -> DeepSpeed-Chat, fastest development -> Trlx, customisation -> ColossalAI",
     _unmeasurable("model size beyond the sweep, development speed and customisation are not measured; see the "
                   "measured decision tree above")),
    ("A20", "recommended DeepSpeed-Chat config for 8 x A100-80G", _unmeasurable(GPU_ONLY)),
    ("B1", "PPO keeps four models resident (actor, reward, critic, reference)", four_models),
    ("B2", "an 8B model's FP16 weights take about 16 GB; four models do not fit one machine",
     _unmeasurable("arithmetic on an 8B model's sizes, not a measurement at this scale")),
    ("B3", "optimizer states usually take more than 2x the weights", optimizer_vs_weights),
    ("B4", "TP within a node, PP across nodes only when needed, DP = GPUs / (TP x PP)",
     _unmeasurable("a planning rule for multi-node GPU clusters")),
    ("B5", "example plan: actor/reference/critic tp8 dp4, reward tp4 dp8", _unmeasurable(GPU_ONLY)),
    ("B6", "recompute activations; bound and reuse the KV cache", _unmeasurable("advice, not a measured quantity")),
    ("B7", "a healthy run keeps peak memory under 90 % of device capacity",
     _unmeasurable("needs device capacity; host RSS on the CPU has none to compare with")),
    ("B8", "large swings in step time between phases signal a bad TP/PP split", _unmeasurable(GPU_ONLY)),
    ("B9", "OOM after ~1,000 steps comes from unreleased caches or fragmentation",
     _unmeasurable("needs runs of ~1,000 steps on a GPU allocator")),
    ("B10", "INT8 inference for reward and reference cuts memory without hurting accuracy",
     _unmeasurable("the harness has no INT8 path")),
    ("B11", "save checkpoints asynchronously about every 500 steps", _unmeasurable("advice, not a measured quantity")),
    ("B12", "keep the reference frozen; tune the KL coefficient if the actor degenerates",
     _unmeasurable("advice, not a measured quantity")),
)


def check_all(rows: Rows, records: Records) -> list[Verdict]:
    return [Verdict(claim_id, claim, *check(rows, records)) for claim_id, claim, check in CLAIMS]
