"""Building blocks shared by the target and draft models."""
