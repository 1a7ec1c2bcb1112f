"""DeepSpeed-Chat re-created on the real deepspeed engine (imported lazily by the adapter)."""
