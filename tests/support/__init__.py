"""Test support shared by the suites: tiny models, service processes, gRPC helpers."""
