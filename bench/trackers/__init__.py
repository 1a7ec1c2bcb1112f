"""Trackers: memory and time per phase, numerical stability per step."""
