"""Compile ptx/*.cu to ptx/*.ptx with NVRTC 12.0 (the `nvidia-cuda-nvrtc-cu12==12.0.140` wheel).

NVRTC 12.0 writes PTX ISA 8.0 for sm_80, which every CUDA 12 and CUDA 13 driver can JIT; nvcc 13
writes ISA 9.0, which CUDA 12 drivers refuse. The compiling is memra_cuda.compile_ptx
(memra_cuda/driver/compiler.py, the one users call for their own kernels) with portable=True, so
no other NVRTC is ever taken (where 12.0 is missing, it says so); this script picks the files,
and the output depends only on the sources: the program name is the bare file name, the
headers a source includes (every ptx/*.cuh) reach NVRTC in memory under their bare file names,
and no option carries a path or line info.

    python ptx/build.py              rewrite ptx/<name>.ptx where its content changed
    python ptx/build.py --out DIR    write the PTX into DIR instead
    python ptx/build.py --check      exit 1, naming the files, if a committed .ptx is stale
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from memra_cuda.driver.compiler import CompileError, compile_ptx  # `make ptx`: the tree's, installed editable

HERE = Path(__file__).resolve().parent


def compile_cu(path: Path) -> str:
    """Return the PTX NVRTC 12.0 makes of the CUDA source at `path`; `#include "<name>.cuh"`
    finds the header of that name beside it. Sources and headers are read as bytes and decoded
    as UTF-8, with no newline translation, so NVRTC sees the files as they are."""
    headers = {header.name: header.read_bytes().decode() for header in sorted(path.parent.glob("*.cuh"))}
    return compile_ptx(path.read_bytes().decode(), name=path.name, headers=headers, portable=True)


def build(out_dir: Path) -> list[Path]:
    """Compile every ptx/*.cu into `out_dir`/<name>.ptx; return the PTX paths in name order.

    A file whose content is unchanged is left untouched.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs = []
    for source in sorted(HERE.glob("*.cu")):
        ptx = compile_cu(source).encode()
        target = out_dir / f"{source.stem}.ptx"
        if not target.is_file() or target.read_bytes() != ptx:
            target.write_bytes(ptx)
        outputs.append(target)
    return outputs


def _stale() -> list[str]:
    """Committed .ptx files that differ from a fresh build, are missing, or have no source."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {path.name: path.read_bytes() for path in build(Path(tmp))}
    committed = {path.name: path.read_bytes() for path in HERE.glob("*.ptx")}
    names = fresh.keys() | committed.keys()
    return sorted(name for name in names if fresh.get(name) != committed.get(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--out", type=Path, default=HERE, help="write the PTX here instead")
    mode.add_argument("--check", action="store_true", help="fail if a committed .ptx is stale")
    args = parser.parse_args(argv)
    try:
        if not args.check:
            build(args.out)
        elif stale := _stale():
            print(f"ptx/build.py: stale PTX, run ptx/build.py: {', '.join(stale)}", file=sys.stderr)
            return 1
    except CompileError as error:
        print(f"ptx/build.py: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
