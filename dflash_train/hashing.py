"""Content hashes of files: the one place a whole file is read to be hashed.

Used for input files (extract/data.py), GGUF targets (target/gguf.py) and checkpoint
checksums (drafter/files.py). Imports nothing heavy, so any stage may use it.
"""

import hashlib
from pathlib import Path

_BLOCK = 1 << 24


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of the file's bytes, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()
