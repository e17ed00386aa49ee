"""Model definitions. Attention goes through runtime.attention backends."""
