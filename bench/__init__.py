"""rlhf-bench core: run/ (spec, launcher, worker, sweeps), measure/ (trackers, FLOPs), results/ (records),
report/, plan/ (memory model and planner). Imports no RLHF framework."""
