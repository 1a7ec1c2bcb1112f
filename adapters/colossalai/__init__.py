"""ColossalChat (coati) re-created on the colossalai Booster (imported lazily by the adapter)."""
