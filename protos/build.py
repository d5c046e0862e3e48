"""Generate the Python gRPC code from ``protos/pdserve/v1/*.proto`` (``python -m protos.build``).

The generated modules live beside the .proto files and are committed; ``tests/protos/test_build.py``
regenerates them into a temporary folder and fails if the committed ones are stale. Imports between
generated modules are rewritten to the installed package path (``protos.pdserve.v1``).
"""
from __future__ import annotations

import glob
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def generate(out_dir: str) -> list[str]:
    import grpc_tools  # lazy: grpc_tools
    from grpc_tools import protoc  # lazy: grpc_tools
    protos = sorted(glob.glob(os.path.join(HERE, "pdserve", "v1", "*.proto")))
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = []
    for path in glob.glob(os.path.join(out_dir, "pdserve", "v1", "*_pb2*.py*")):
        with open(path) as f:
            src = f.read()
        src = re.sub(r"^from pdserve\.v1 import", "from protos.pdserve.v1 import", src, flags=re.M)
        with open(path, "w") as f:
            f.write(src)
        written.append(path)
    return sorted(written)


def main() -> int:
    for p in generate(HERE):
        print(os.path.relpath(p, os.path.dirname(HERE)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
