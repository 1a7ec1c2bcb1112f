"""What torch's gloo backend holds while it all-gathers into one tensor, the collective ZeRO-3 gathers each
parameter with on the host.

Each rank holds half of a 93.75 MiB fp32 tensor (llama-base's embedding) and all-gathers it into a fresh output
with `all_gather_into_tensor`, once synchronously and once asynchronously with the work handle kept after its
wait (DeepSpeed keeps its handles until a parameter's fetch completes). A 0.5 ms sampler thread reads rank 0's
RSS; the script prints the peak over the RSS before the output was allocated, the rise after the wait, after the
output is freed, and after the handle is dropped. On a GPU, NCCL gathers into the output itself.

    MALLOC_MMAP_THRESHOLD_=131072 torchrun --standalone --nproc_per_node 2 scripts/diagnostics/gloo_allgather_copy.py
"""

from __future__ import annotations

import threading
import time

import psutil
import torch
import torch.distributed as dist

MIB = 2**20
ELEMENTS = 24_576_000  # 32,000 x 768
SETTLE_S = 0.05


class PeakSampler:
    def __init__(self) -> None:
        self.process, self.peak, self.running = psutil.Process(), 0, True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.0005)

    def rss(self) -> int:
        return self.process.memory_info().rss


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    part = torch.randn(ELEMENTS // world)
    sampler = PeakSampler()
    for asynchronous in (False, True):
        dist.barrier()
        time.sleep(SETTLE_S)
        base, sampler.peak = sampler.rss(), 0
        out = torch.empty(ELEMENTS)
        work = dist.all_gather_into_tensor(out, part, async_op=asynchronous)
        if work is not None:
            work.wait()
        time.sleep(SETTLE_S)
        after_wait = sampler.rss()
        del out
        time.sleep(SETTLE_S)
        output_freed = sampler.rss()
        work = None
        time.sleep(SETTLE_S)
        if dist.get_rank() == 0:
            print(f"{'async, handle kept' if asynchronous else 'sync'}: output {ELEMENTS * 4 / MIB:.2f} MiB; RSS "
                  f"peak +{(sampler.peak - base) / MIB:.1f} MiB, after the wait +{(after_wait - base) / MIB:.1f}, "
                  f"output freed +{(output_freed - base) / MIB:.1f}, handle dropped "
                  f"+{(sampler.rss() - base) / MIB:.1f}", flush=True)
    sampler.running = False
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
