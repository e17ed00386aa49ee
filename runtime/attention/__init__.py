"""Attention backends behind one interface, chosen by name through `registry`."""
