"""The weights fingerprint of a transformers checkpoint directory: its identity in the store.

Owns which files count as the weights and which of their bytes are read. A target is the
same target wherever it lies when its fingerprint is the same, and another target at the same
path when it is not (see StoreMeta.mismatches). A GGUF target needs none of this: its whole
file is hashed (gguf.py). Never writes anything.

What is read, per weight file (*.safetensors; *.bin when there is none): its name and size,
a safetensors file's whole header (every tensor's name, dtype, shape and byte offsets), and
SAMPLES windows of the tensor data: the first, middle and last 1 MiB plus 16 evenly spaced
64 KiB windows, 4 MiB in all (a file under that is read whole). On the 11 ~5 GB shards of a
27B target that is ~44 MiB in 19 reads per file: measured 12-17 ms per cold 5 GB shard on a
local virtio disk and 45-75 ms of hashing for 11 shards, against 7 s to sha256 one whole shard.

It tells a replaced, retrained or re-quantized checkpoint from the original (its headers or
its sampled bytes differ, which any new training or conversion changes everywhere) and names a
copy at another path as the same target. It does not see a change confined to bytes outside
the windows (a single flipped byte mid-file): that is bit rot, which the hashes of a full copy
or the file system must catch, not a different model.
"""

import hashlib
import struct
from pathlib import Path

from dflash_train.target_model.errors import TargetError

EDGE = 1 << 20
"""Bytes read at the start, middle and end of each file's tensor data."""
WINDOWS = 16
WINDOW = 64 << 10
"""WINDOWS evenly spaced windows of WINDOW bytes each, between the edges."""
MAX_HEADER = 100 << 20
"""A safetensors header larger than this is taken for a damaged file (real ones are < 10 MB)."""


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's weight files, sorted by name: *.safetensors, else *.bin."""
    for pattern in ("*.safetensors", "*.bin"):
        found = sorted(p for p in directory.glob(pattern) if p.is_file())
        if found:
            return found
    return []


def fingerprint(directory: str | Path) -> str | None:
    """sha256 over every weight file's name, size, header and sampled windows (module
    docstring); None for a directory without weight files (nothing to fingerprint)."""
    files = weight_files(Path(directory))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        try:
            _update(digest, path)
        except OSError as e:
            raise TargetError(f"--model {directory}: cannot read {path.name} to fingerprint "
                               f"the weights ({e.strerror or e})") from e
    return digest.hexdigest()


def _update(digest, path: Path) -> None:
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        start = _header_end(fh, size) if path.suffix == ".safetensors" else 0
        digest.update(f"{path.name}\0{size}\0".encode())
        for offset, length in [(0, start)] + windows(start, size):
            fh.seek(offset)
            digest.update(fh.read(length))


def _header_end(fh, size: int) -> int:
    """Where a safetensors file's tensor data starts: 8-byte length + JSON header."""
    fh.seek(0)
    head = fh.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
    if 8 + n > min(size, 8 + MAX_HEADER):
        raise TargetError(f"{fh.name}: not a safetensors file (header of {n} bytes in a file "
                           f"of {size}); re-download it")
    return 8 + n


def windows(start: int, stop: int) -> list[tuple[int, int]]:
    """(offset, length) of the sampled windows of [start, stop), ascending, not overlapping;
    the whole range when it is no larger than the windows together."""
    span = stop - start
    if span <= 3 * EDGE + WINDOWS * WINDOW:
        return [(start, span)]
    middle = start + (span - EDGE) // 2
    picks = [(start, EDGE), (middle, EDGE), (stop - EDGE, EDGE)]
    step = (span - 2 * EDGE - WINDOW) // (WINDOWS + 1)
    picks += [(start + EDGE + step * (i + 1), WINDOW) for i in range(WINDOWS)]
    picks.sort()
    out: list[tuple[int, int]] = []
    for offset, length in picks:  # a window inside the middle edge is merged into it
        if out and offset < out[-1][0] + out[-1][1]:
            end = max(out[-1][0] + out[-1][1], offset + length)
            out[-1] = (out[-1][0], end - out[-1][0])
        else:
            out.append((offset, length))
    return out
