"""Hugging Face TRL (the PyPI package): its own trainers, measured by the harness (package name: not `trl`)."""
