"""Generated from proto/dflash/v1/*.proto by `make proto` (protoc from grpcio-tools 1.84.0)."""
