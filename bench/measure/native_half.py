"""Whether this CPU runs a half precision's matrix products natively: the one list of the instructions each needs,
read by the runs (a record's note that its times are an emulation's) and by the curated scripts' host check
(`python -m bench.measure.native_half bf16 [--cpuinfo FILE]`: exit 0 when native, 1 with the reason).

Without them torch's half-precision matrix products on the CPU take a slow path: fp16 on an AVX512 Xeon without
AVX512-FP16 or AMX, about 75x fp32's time for glm-base's matrix products; bf16 on an AVX2-only AMD EPYC (no
AVX-512 at all), 15-19x fp32's step time in glm-base's SFT (DS-Chat, trlx and ColossalChat at ZeRO-2, batch 3,
64 + 96 tokens, 2 ranks).
"""

from __future__ import annotations

import argparse
import sys

from bench.measure.environment import CPUINFO, cpu_flags

NATIVE_HALF = {"fp16": (("avx512_fp16", "amx_fp16"), "about 75x fp32's time for glm-base's matrix products"),
               "bf16": (("avx512_bf16", "amx_bf16"), "15-19x fp32's step time in glm-base's SFT")}


def emulated_half(precision: str, device_type: str, cpuinfo: str = CPUINFO) -> str | None:
    """The note a half-precision run on a CPU without that precision's native matrix instructions carries: its
    times are torch's slow path, not the framework's (memory and numerics are unaffected). `cpuinfo`: the file
    the CPU's flags are read from."""
    if precision not in NATIVE_HALF or device_type != "cpu":
        return None
    flags, cost = NATIVE_HALF[precision]
    if set(flags) & cpu_flags(cpuinfo):
        return None
    return (f"{precision} on a CPU without {' or '.join(flags)}: torch's {precision} matrix products take a slow "
            f"path here ({cost} on such hosts), so this run's times are not the framework's")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.measure.native_half", description=__doc__.splitlines()[0])
    parser.add_argument("precision", choices=sorted(NATIVE_HALF))
    parser.add_argument("--cpuinfo", default=CPUINFO, help=f"the file the CPU's flags are read from ({CPUINFO})")
    args = parser.parse_args(argv)
    note = emulated_half(args.precision, "cpu", args.cpuinfo)
    if note is None:
        return 0
    print(note, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
