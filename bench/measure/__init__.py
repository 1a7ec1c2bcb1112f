"""Measuring: the trackers (memory and time per phase, numerical stability per step, the tensors an object
holds, time in the JIT loader), the FLOPs formula and parameter counts, the environment fingerprint, and
the trend fits of soak runs."""
