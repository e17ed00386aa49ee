"""Benchmarks (CPU and GPU): each module writes JSON under bench/results/ and its section
of docs/benchmarks.md."""
