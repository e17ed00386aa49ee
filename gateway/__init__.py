"""The gateway: upstream clients, the speculative loop, the gRPC and OpenAI APIs, the local stack."""
