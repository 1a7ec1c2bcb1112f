"""`python -m bench.run [overrides]`: validate the config, run the benchmark, print the result table.

Exit status: 0 when a record was written (its `status` says ok, oom, nan, error, timeout, ...);
2 when the configuration is invalid or unsupported, in which case nothing was launched. Under `-m`
(a sweep) such a run leaves an `unsupported` / `error` record instead and the sweep goes on.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console

from bench.benchmark import RECORD_FILE, run_benchmark
from bench.config import CONF_DIR, to_plain
from bench.record import ResultRecord, StageRecord
from bench.spec import SpecError, UnsupportedError, spec_from_config
from bench.table import print_record

log = logging.getLogger("bench.run")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    run_dir = HydraConfig.get().runtime.output_dir
    config = to_plain(cfg)
    console = Console()
    sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        spec = spec_from_config(config)
    except SpecError as err:
        console.print(f"[bold red]invalid configuration:[/bold red] {err}")
        if isinstance(err, UnsupportedError) or sweeping:
            # Keep a record so a sweep shows the cell; a sweep goes on to its next run.
            status = "unsupported" if isinstance(err, UnsupportedError) else "error"
            record = ResultRecord(run_id=os.path.basename(run_dir), config=config, status=status,
                                  error={"message": str(err), "phase": "validation"})
            record.stages[config["stage"]["name"]] = StageRecord(status=status, error=record.error)
            record.write(os.path.join(run_dir, RECORD_FILE))
        if sweeping:
            return
        sys.exit(2)
    cache_dir = os.path.join(config["output_root"], "cache")
    record = run_benchmark(spec, run_dir, config, cache_dir)
    print_record(record.to_dict(), os.path.join(run_dir, RECORD_FILE), console)


if __name__ == "__main__":
    main()
