"""rlhf-bench core: run spec, launcher, trackers, records. Imports no RLHF framework."""
