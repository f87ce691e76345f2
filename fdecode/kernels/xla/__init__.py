"""The plain-XLA backend (the CPU default): dense caches (`dense`) and sparse index lists
(`sparse`)."""
