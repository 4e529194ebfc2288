"""Generated gRPC/protobuf code for package minite.v1 (proto/minite/v1/*.proto): `make proto` regenerates it."""
