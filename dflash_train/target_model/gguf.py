"""GGUF targets: `--model` naming a .gguf file, or a directory holding exactly one.

Owns recognising such a target, where transformers reads it from (it dequantizes the weights
on load), and its identity: the sha256 of the file's bytes, recorded as the target's revision
(`gguf-sha256:<hex>`), so another file swapped in at the same path is another target. A
directory holding a config.json is a transformers checkpoint, never a GGUF target. Never
writes anything.
"""

import copy
import functools
import os
from pathlib import Path

from dflash_train.hashing import file_sha256
from dflash_train.target_model.errors import TargetError

MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""
REVISION_PREFIX = "gguf-sha256:"
"""How a GGUF target's content hash is spelled in the store's target.revision."""


def find_gguf(name_or_path: str) -> Path | None:
    """The .gguf file `--model` names (itself, or the only one in a directory without a
    config.json), or None for anything else; TargetError for an ambiguous directory or a
    .gguf file that is not one."""
    p = Path(name_or_path)
    if p.is_dir():
        if (p / "config.json").exists():
            return None
        found = sorted(q for q in p.iterdir() if q.suffix.lower() == ".gguf" and q.is_file())
        if len(found) > 1:
            raise TargetError(f"--model {name_or_path}: holds {len(found)} .gguf files "
                               f"({', '.join(q.name for q in found)}); pass the one to load")
        if not found:
            return None
        p = found[0]
    elif not (p.is_file() and p.suffix.lower() == ".gguf"):
        return None
    with open(p, "rb") as fh:
        head = fh.read(len(MAGIC))
    if head != MAGIC:
        raise TargetError(f"--model {p}: not a GGUF file (starts with {head!r}, not {MAGIC!r})")
    return p.resolve()


def damage(path: Path) -> str | None:
    """Why the gguf package cannot read the file (its metadata, tensor table, or tensors cut
    short), or None when it can. Asked only after transformers failed on the file: some
    damage it reports as 'a config file that is not valid JSON' (a string that is not
    UTF-8), some as an unpack error; the package's own reader says whether the file is it."""
    from gguf import GGUFReader

    try:
        GGUFReader(path)  # memory-maps the file: checks the tensors fit, copies none
    except Exception as e:  # struct, numpy and UnicodeDecodeError alike: it does not parse
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def reader_arguments(path: Path) -> tuple[str, dict]:
    """(directory, kwargs) for transformers' from_pretrained on a GGUF file."""
    return str(path.parent), {"gguf_file": path.name}


def _stat_key(path: Path) -> tuple:
    s = os.stat(path)
    return (str(path), s.st_size, s.st_mtime_ns, s.st_ino)


def revision(path: Path) -> str:
    """The target identity recorded for a GGUF file: its content hash."""
    return REVISION_PREFIX + _sha256(_stat_key(path))


@functools.lru_cache(maxsize=8)
def _sha256(key: tuple) -> str:
    # keyed by size, mtime and inode too: a file replaced at the same path is hashed again
    return file_sha256(key[0])


def read_gguf_config(path: Path):
    """The transformers config a GGUF's metadata describes (a copy: callers may edit it).

    Reading it parses every metadata field, the whole vocabulary included (seconds for a
    49k-token vocabulary), so one process reads each file once."""
    return copy.deepcopy(_read_config(_stat_key(path)))


@functools.lru_cache(maxsize=8)
def _read_config(key: tuple):
    from transformers import AutoConfig

    directory, kwargs = reader_arguments(Path(key[0]))
    return AutoConfig.from_pretrained(directory, **kwargs)
