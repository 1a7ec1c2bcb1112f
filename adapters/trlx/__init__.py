"""Trlx re-created on accelerate and its DeepSpeed plugin (imported lazily by the adapter)."""
