"""The planner: per-GPU memory predicted from the model and the layout, before launch (issue 13)."""
