"""Framework adapters. Each framework lives in its own package and is imported only when selected."""
