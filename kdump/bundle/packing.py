"""Packing: fold a bundle whose blobs may live in a capture directory's shared store into one
self-contained file (`pack`), and where `kdump pack` puts that copy (`pack_destination`)."""

from __future__ import annotations

import filecmp
import os
from dataclasses import replace
from pathlib import Path

from kdump.bundle.manifest import blob_alignments
from kdump.bundle.reader import STORE_SEARCH_DEPTH, load_bundle
from kdump.bundle.writer import Progress, write_whole
from kdump.errors import UsageError
from kdump.format.records import STORE_DIRNAME, Where, manifest_json


def pack(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    progress: Progress | None = None,
    force: bool = False,
) -> Path:
    """Rewrite a bundle (whose blobs may live in a shared store) as one self-contained file;
    `progress` is told the blob bytes written (`packed_bytes` of the bundle in all). A file
    already at `dst` is replaced only with `force` or when it holds the same bytes (UsageError
    otherwise, and it stays as it was)."""
    bundle = load_bundle(src)
    bundle.verify()
    m = bundle.manifest
    inline = {sha: replace(b, where=Where.INLINE) for sha, b in m.blobs.items()}
    aligns = blob_alignments(m.calls)
    views = {
        sha: (bundle.blob_bytes(sha), aligns.get(sha, 0)) for sha, b in m.blobs.items() if b.nbytes
    }
    out = Path(dst)
    out.parent.mkdir(parents=True, exist_ok=True)
    manifest = manifest_json(replace(m, blobs=inline))
    if force or not os.path.lexists(out):
        write_whole(out, manifest, views, progress)
        return out
    # Something is there already: written beside it first, kept only when it is the same.
    if not out.is_file():
        raise UsageError(f"{out} exists and is not a file; pass another -o")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.pack-tmp")
    try:
        write_whole(tmp, manifest, views, progress)
        if not filecmp.cmp(tmp, out, shallow=False):
            raise UsageError(
                f"{out} exists and holds something else; pass --force to overwrite it, or "
                "another -o"
            )
    finally:
        tmp.unlink(missing_ok=True)
    return out


def packed_bytes(src: str | os.PathLike[str]) -> int:
    """The blob bytes `pack` writes for bundle `src` (its header is read, no blob)."""
    with load_bundle(src) as bundle:
        return sum(b.nbytes for b in bundle.manifest.blobs.values())


PACKED_SUFFIX = ".packed"


def capture_root(bundle: str | os.PathLike[str]) -> Path | None:
    """The capture directory (the folder holding the shared blob store) a bundle belongs to,
    looked for where the reader looks for its store; None for a bundle outside one."""
    return _store_folder(Path(bundle).resolve().parent)


def _lexical(path: str | os.PathLike[str]) -> Path:
    """An absolute path as given: `..` folded, symlinks not followed (a link packs beside the
    link, not beside what it points to)."""
    return Path(os.path.abspath(path))


def _lexical_capture_root(bundle: Path) -> Path | None:
    """capture_root, looked for along the path as given."""
    return _store_folder(bundle.parent)


def _store_folder(here: Path) -> Path | None:
    """The first of `here` and the folders above it, as deep as the reader looks for a store,
    that holds a blob store."""
    for cand in [here, *list(here.parents)[:STORE_SEARCH_DEPTH]]:
        if (cand / STORE_DIRNAME).is_dir():
            return cand
    return None


def _inside(path: Path, folder: Path) -> bool:
    """Whether `path` is inside `folder`, as given or with symlinks followed on either side."""
    real_path, real_folder = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return any(p.is_relative_to(f) for p in (path, real_path) for f in (folder, real_folder))


def pack_destination(
    src: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    base: str | os.PathLike[str] | None = None,
) -> Path:
    """Where `kdump pack` writes the packed copy of bundle `src` (found under folder `base`, if
    one was given): never inside the capture directory or `base`, so a later replay of that
    folder does not replay the copy as well. Paths count as given: a symlinked bundle packs
    beside the link, under its name (and its target's capture directory is kept clear too).

    Default: `<root>.packed/<path of src under root>` beside `root`, the outer of `base` and the
    capture directory, else the bundle's own folder. An `output` that is an existing folder
    receives the bundle under its name (its path under `base` when packing a folder); any other
    `output` is the file to write."""
    src_p = _lexical(src)
    base_p = _lexical(base) if base is not None else None
    capture = _lexical_capture_root(src_p)
    # Both hold src, so one holds the other: the outer one is the folder a replay would read.
    folders = [f for f in (capture, base_p) if f is not None]
    root = min(folders, key=lambda f: len(f.parts)) if folders else src_p.parent
    if output is None:
        if not root.name:  # the file system's root has no folder beside it
            raise UsageError(f"{src}: no default place beside {root} for the packed copy; pass -o")
        dst = root.with_name(root.name + PACKED_SUFFIX) / src_p.relative_to(root)
    elif Path(output).is_dir():
        inner = src_p.relative_to(base_p) if base_p is not None else Path(src_p.name)
        dst = _lexical(output) / inner
    else:
        dst = _lexical(output)
    if dst == src_p or os.path.realpath(dst) == os.path.realpath(src_p):
        raise UsageError(f"{src}: the packed copy would overwrite the bundle; pass another -o")
    real_capture = capture_root(src_p)  # where the bundle's store really is
    for folder in {*folders, *([real_capture] if real_capture is not None else [])}:
        if _inside(dst, folder):
            raise UsageError(
                f"{dst} is inside {folder}, which a replay would read twice; pass -o outside it"
            )
    return dst
