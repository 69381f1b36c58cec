"""Generates the Python gRPC stubs from the proto files with grpcio-tools."""

from __future__ import annotations

import fcntl
import sys
from pathlib import Path

API_DIR = Path(__file__).resolve().parent / "api"
REPO_ROOT = API_DIR.parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ["inference/v1/inference.proto"]
_OUTPUTS = ["inference_pb2.py", "inference_pb2_grpc.py", "inference_pb2.pyi"]


def _is_stale() -> bool:
    out_dir = API_DIR / "inference" / "v1"
    outputs = [out_dir / name for name in _OUTPUTS]
    if not all(p.exists() for p in outputs):
        return True
    newest_proto = max((PROTO_ROOT / f).stat().st_mtime for f in PROTO_FILES)
    return min(p.stat().st_mtime for p in outputs) < newest_proto


def generate() -> None:
    """Runs protoc, mapping `proto/` onto this package so the stubs import each other by package path."""
    from grpc_tools import protoc  # imported lazily: only the build needs it

    args = [
        "grpc_tools.protoc",
        f"-Iinference_service/api={PROTO_ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={REPO_ROOT}",
        f"--grpc_python_out={REPO_ROOT}",
        f"--pyi_out={REPO_ROOT}",
        *[str(PROTO_ROOT / f) for f in PROTO_FILES],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {PROTO_FILES}")
    for pkg in (API_DIR / "inference", API_DIR / "inference" / "v1"):
        (pkg / "__init__.py").touch()


def ensure_generated() -> None:
    """Generates the stubs if missing or stale; safe when several processes import at once."""
    if not PROTO_ROOT.exists() or not _is_stale():
        return
    API_DIR.mkdir(parents=True, exist_ok=True)
    with open(API_DIR / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_stale():
            generate()


if __name__ == "__main__":
    generate()
    print(f"generated stubs for {PROTO_FILES} under {API_DIR}", file=sys.stderr)
