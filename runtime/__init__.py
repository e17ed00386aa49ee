"""Model runtime shared by the target and draft services: models, layers, attention, KV cache."""
