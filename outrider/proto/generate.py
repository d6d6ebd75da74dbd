"""Regenerate the committed stubs from `outrider.proto`: `python -m outrider.proto.generate`.

The stubs are committed so a fresh install needs no protoc (grpcio-tools is a test extra);
`tests/cpu/proto/test_stubs.py` fails when they drift from the `.proto`.

protoc runs on a copy laid out as the installed package (`outrider/proto/outrider.proto`), so
the file is known by that path and the gRPC stub imports `from outrider.proto import
outrider_pb2`: the stubs work as part of this package, never as a top-level module.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_FILE = PACKAGE_DIR / "outrider.proto"
GENERATED_NAMES = ("outrider_pb2.py", "outrider_pb2.pyi", "outrider_pb2_grpc.py")


@contextmanager
def staged_proto() -> Iterator[tuple[Path, Path]]:
    """(include dir, path of the .proto relative to it) for a copy laid out as installed."""
    with tempfile.TemporaryDirectory() as include:
        relative = Path("outrider", "proto", PROTO_FILE.name)
        (Path(include) / relative).parent.mkdir(parents=True)
        shutil.copyfile(PROTO_FILE, Path(include) / relative)
        yield Path(include), relative


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs into `out_dir` (flat) and return their paths.

    Raises ImportError without grpcio-tools and RuntimeError when protoc fails.
    """
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as scratch, staged_proto() as (include, relative):
        args = [
            "grpc_tools.protoc",
            f"--proto_path={include}",
            f"--proto_path={well_known}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            str(relative),
        ]
        # protoc resolves the relative proto path against the include path, not the cwd.
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED_NAMES:
            target = out_dir / name
            shutil.copyfile(Path(scratch) / relative.parent / name, target)
            written.append(target)
    return written


def main() -> int:
    for path in generate(PACKAGE_DIR):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
