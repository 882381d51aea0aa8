"""Store a device run's raw archive in docs/perf-raw as one flat .tar.xz.

`gpu_bench.sh` leaves raw.tgz with the run directories inside it as a second archive (runs.tgz); gzip over
gzip keeps the request logs' JSON ~2.4x larger than xz over the plain files. The device machine takes a working
tree of at most 64 MiB, and by session 36 the tracked files were 59.6 MB, 53 of them such archives. So every
archive is kept as xz over its files, nested .tgz/.tar.gz expanded where they lay (into a folder named after
the archive where a name would collide), and checked file by file against the source before it is written.

    python benchmarks/store_raw.py SRC.tgz DEST.tar.xz     # one archive
    python benchmarks/store_raw.py --in-place FOLDER        # every *.tgz in FOLDER, each replaced
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import tarfile
from pathlib import Path, PurePosixPath

NESTED = (".tgz", ".tar.gz")


def leaves(data: bytes) -> dict[str, bytes]:
    """Every regular file of an archive by path, nested archives expanded."""
    out: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        names = {PurePosixPath(m.name) for m in members}
        for member in members:
            raw = tar.extractfile(member).read()
            path = PurePosixPath(member.name)
            if not path.name.endswith(NESTED):
                out[str(path)] = raw
                continue
            inner = leaves(raw)
            base = path.parent
            if any(base / name in names for name in inner):
                base = path.parent / path.name.split(".")[0]
            for name, value in inner.items():
                out[str(base / name)] = value
    return out


def pack(files: dict[str, bytes]) -> bytes:
    """A .tar.xz of `files`, sorted by path, mtimes 0 (the same files give the same bytes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", preset=9) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(str(PurePosixPath(name)))
            info.size = len(files[name])
            tar.addfile(info, io.BytesIO(files[name]))
    return buf.getvalue()


def _digests(files: dict[str, bytes]) -> dict[str, str]:
    return {str(PurePosixPath(name)): hashlib.sha256(value).hexdigest() for name, value in files.items()}


def store(src: Path, dest: Path) -> tuple[int, int]:
    """Write src's files to dest as flat .tar.xz; (bytes before, after). Raises if the two differ in a file."""
    data = src.read_bytes()
    files = leaves(data)
    packed = pack(files)
    if _digests(leaves(packed)) != _digests(files):
        raise RuntimeError(f"{dest}: its files differ from {src}'s")
    dest.write_bytes(packed)
    return len(data), len(packed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="SRC DEST, or with --in-place a folder")
    parser.add_argument("--in-place", action="store_true", help="replace every *.tgz of the folder")
    args = parser.parse_args(argv)
    if args.in_place:
        if len(args.paths) != 1 or not args.paths[0].is_dir():
            parser.error("--in-place takes one folder")
        pairs = [(src, src.with_name(src.name.removesuffix(".tgz") + ".tar.xz"))
                 for src in sorted(args.paths[0].glob("*.tgz"))]
    elif len(args.paths) != 2 or args.paths[1].suffixes[-2:] != [".tar", ".xz"]:
        parser.error("give SRC and DEST.tar.xz")
    else:
        pairs = [tuple(args.paths)]
    before = after = 0
    for src, dest in pairs:
        old, new = store(src, dest)
        before, after = before + old, after + new
        if args.in_place:
            src.unlink()
        print(f"{dest.name}: {old} -> {new} bytes")
    print(f"{len(pairs)} archives: {before / 1e6:.1f} -> {after / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
