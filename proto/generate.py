"""Regenerate the committed stubs from `outrider.proto`: `python -m proto.generate`.

The stubs are committed so a fresh install needs no protoc (grpcio-tools is a test extra);
`tests/cpu/proto/test_stubs.py` fails when they drift from the `.proto`.

protoc runs with the repository root as its include path, so the file is known as
`proto/outrider.proto` and the gRPC stub imports `from proto import outrider_pb2`: the stubs
work as part of this package, never as a top-level `outrider_pb2` module.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
PROTO_FILE = PACKAGE_DIR / "outrider.proto"
GENERATED_NAMES = ("outrider_pb2.py", "outrider_pb2.pyi", "outrider_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs into `out_dir` (flat) and return their paths.

    Raises ImportError without grpcio-tools and RuntimeError when protoc fails.
    """
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as scratch:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={REPO_ROOT}",
            f"--proto_path={well_known}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            str(PROTO_FILE.relative_to(REPO_ROOT)),
        ]
        # protoc resolves the relative proto path against the include path, not the cwd.
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED_NAMES:
            target = out_dir / name
            shutil.copyfile(Path(scratch) / PACKAGE_DIR.name / name, target)
            written.append(target)
    return written


def main() -> int:
    for path in generate(PACKAGE_DIR):
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
