"""Regenerate the Python modules and .pyi stubs from protos/*.proto.

Usage: python scripts/gen_protos.py [--check]

protoc derives Python import paths from the include path, so the .proto files
are laid out under swarmpipe/protos/ in a scratch folder first: generated code
then imports `swarmpipe.protos.tensor_pb2`, never a bare `tensor_pb2`.
With --check nothing is written; the exit code is 1 when the committed
modules differ from what the .proto files generate.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

PROTOS = Path(__file__).resolve().parent.parent / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into out_dir; return the generated files."""
    from grpc_tools import protoc

    scratch = out_dir / "in"
    target = scratch / "swarmpipe" / "protos"
    target.mkdir(parents=True)
    sources = sorted(PROTOS.glob("*.proto"))
    for src in sources:
        shutil.copy(src, target / src.name)
    gen = out_dir / "out"
    gen.mkdir()
    well_known = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{scratch}",
        f"-I{well_known}",
        f"--python_out={gen}",
        f"--mypy_out={gen}",
        f"--grpc_python_out={gen}",
        f"--mypy_grpc_out={gen}",
        *[str(Path("swarmpipe/protos") / s.name) for s in sources],
    ]
    # The mypy plugins are console scripts installed beside this interpreter.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    return sorted((gen / "swarmpipe" / "protos").iterdir())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = [f for f in generate(Path(tmp)) if f.name.endswith(GENERATED_SUFFIXES)]
        stale = [
            f.name
            for f in files
            if not (PROTOS / f.name).exists() or (PROTOS / f.name).read_bytes() != f.read_bytes()
        ]
        expected = {f.name for f in files}
        extra = [
            p.name
            for p in PROTOS.iterdir()
            if p.name.endswith(GENERATED_SUFFIXES) and p.name not in expected
        ]
        if args.check:
            if stale or extra:
                print(
                    "generated protobuf code is stale: "
                    + ", ".join(stale + extra)
                    + "; run `python scripts/gen_protos.py`",
                    file=sys.stderr,
                )
                return 1
            return 0
        for f in files:
            shutil.copy(f, PROTOS / f.name)
        for name in extra:
            (PROTOS / name).unlink()
        print(f"wrote {len(files)} files into {PROTOS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
