"""Generated protobuf and gRPC code (python -m treeserve.protogen); do not edit by hand."""
