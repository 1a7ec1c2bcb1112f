"""Running a benchmark: the typed run spec from the Hydra config, the command line and its checks, the
launcher (one isolated process tree per stage), the worker and its step loop, checkpoints, sweeps, and the
workload (synthetic data, models built from configs). `python -m bench.run` is its entry point."""
