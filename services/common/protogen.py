"""Regenerates the gRPC/protobuf code in treeserve/v1 from protos/treeserve/v1/*.proto.

    python -m treeserve.protogen        # after editing a .proto (needs the test extras: grpcio-tools)

The generated files are committed; tests/test_protos.py fails when they are stale.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
GENERATED = Path(__file__).resolve().parent / "v1"  # the package treeserve.v1


def generate(out_dir: Path) -> list[Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto into out_dir; returns their paths."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "treeserve" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        if protoc.main(args + protos) != 0:
            raise RuntimeError("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        # protoc mirrors the proto path (treeserve/v1/...), which is exactly this package's import path.
        for path in sorted((Path(tmp) / "treeserve" / "v1").iterdir()):
            written.append(Path(shutil.copy(path, out_dir / path.name)))
    return written


if __name__ == "__main__":
    for path in generate(GENERATED):
        print(path.relative_to(REPO))
    sys.exit(0)
