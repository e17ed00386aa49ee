"""DFlash speculative decoding as gRPC services. `dflash.v1` holds the generated protocol code."""
