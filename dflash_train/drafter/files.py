"""A drafter directory's files on disk: published whole or not at all, and checked whole
before they are trusted.

Every directory we write holds `checksums.json` (sha256 of the other files, written last):
load_drafter verifies it when present, so flipped bytes are refused instead of being
evaluated, exported or resumed. Serving engines read config.json and *.safetensors only and
ignore other files; directories without the record (z-lab / HF downloads) load unverified.
A training checkpoint around `drafter/` loads only when it is whole (check_checkpoint_whole:
its COMPLETE marker and its own checksums.json), so a half-copied one is refused by eval,
export and init_from alike. No weight holding NaN or Inf is ever written or loaded
(check_finite, the one check every writer of weights and optimiser state calls).

Directories are written atomically (temp dir + rename; an overwrite swaps the two in one
step where Linux offers it) with the modes the user's umask gives
new files (a serving engine running as another user must read them); an overwrite replaces
only a previous drafter's own files. Never deletes a directory that holds anything else. A
single-file export (a GGUF) is published the same way: a sibling temp file, then a rename.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from dflash_train.drafter.errors import DrafterError
from dflash_train.drafter.hf_config import ARCHITECTURES
from dflash_train.hashing import file_sha256
from dflash_train.run_layout import (
    CHECKSUMS_NAME,
    COMPLETE,
    CONFIG_NAME,
    DRAFTER_SUBDIR,
    OWN_FILES,
)

PROC_STATUS = Path("/proc/self/status")
"""Where Linux reports the process's umask without it being changed to read it."""


class DamagedFile(DrafterError):
    """A file a directory's record (checksums.json, the COMPLETE marker) vouches for is
    missing or differs; `path` names it, `reason` says how."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def nonfinite_tensors(tree: Any, prefix: str = "") -> list[str]:
    """Dotted names of the floating-point tensors holding NaN or Inf anywhere in `tree` (a
    tensor, or dicts / lists / tuples of them: a state dict, an optimizer state)."""
    if isinstance(tree, torch.Tensor):
        bad = (tree.is_floating_point() or tree.is_complex()) and not bool(
            torch.isfinite(tree).all())
        return [prefix or "tensor"] if bad else []
    if isinstance(tree, Mapping):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return []
    return [name for key, value in items
            for name in nonfinite_tensors(value, f"{prefix}.{key}" if prefix else str(key))]


def check_finite(tree: Any, what: str) -> None:
    """Refuse `what` (weights or optimizer state about to be written, or just read) when
    any of its tensors holds NaN or Inf: a diverged run's state is never kept as a
    checkpoint, an export or a drafter to evaluate."""
    bad = nonfinite_tensors(tree)
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise DrafterError(f"{what}: {shown} hold(s) NaN or Inf (a diverged run?); refusing "
                           "to use them")


def cast_weight(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """`tensor` (finite: check_finite ran) in `dtype`, refusing one whose values the dtype
    cannot hold: float16 tops out at 65504, and a larger weight would be written as Inf."""
    cast = tensor.to(dtype)
    if cast.is_floating_point() and not bool(torch.isfinite(cast).all()):
        largest = float(tensor.abs().max())
        short = str(dtype).removeprefix("torch.")
        raise DrafterError(f"weight {name} holds {largest:.6g}, beyond {short}'s largest value "
                           f"({torch.finfo(dtype).max:.6g}); export as bfloat16 or float32 "
                           "(--dtype), which hold it")
    return cast


def check_checkpoint_whole(root: str | os.PathLike) -> None:
    """Refuse a training checkpoint that is not whole, naming what is missing or differs:
    no COMPLETE marker (a save or a copy cut short), or a file its checksums.json lists that
    is missing or differs (the drafter/ directory must then carry its own record too).
    A checkpoint written before checksums.json existed is checked for its marker only."""
    root = Path(root)
    if not (root / COMPLETE).is_file():
        raise DamagedFile(
            root, f"not a complete training checkpoint (no {COMPLETE} marker: its save "
            "or its copy was cut short); copy it again whole, or pick another checkpoint")
    if not (root / CHECKSUMS_NAME).is_file():
        return
    verify_checksums(root)
    drafter_record = root / DRAFTER_SUBDIR / CHECKSUMS_NAME
    if not drafter_record.is_file():
        raise DamagedFile(drafter_record, f"missing, though the checkpoint {root} records "
                          "checksums (its copy was cut short?); copy it again whole")


def write_checksums(directory: Path, names: list[str]) -> None:
    """Record the sha256 of `names` in `directory`/checksums.json, last and atomically."""
    record = {"algorithm": "sha256",
              "files": {name: file_sha256(directory / name) for name in names}}
    tmp = directory / f".{CHECKSUMS_NAME}.tmp"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, directory / CHECKSUMS_NAME)


def verify_checksums(directory: str | os.PathLike) -> bool:
    """Check the files against checksums.json; False when there is no record (third-party
    directories), DrafterError naming the file when one differs or is missing."""
    directory = Path(directory)
    record_path = directory / CHECKSUMS_NAME
    if not record_path.is_file():
        return False
    try:
        record = json.loads(record_path.read_text())
        files = record["files"]
        if record.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise ValueError("expected {'algorithm': 'sha256', 'files': {name: hex}}")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise DrafterError(f"{record_path}: unreadable checksum record ({err})") from err
    for name, want in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise DamagedFile(path, f"listed in {CHECKSUMS_NAME} but missing")
        got = file_sha256(path)
        if got != want:
            raise DamagedFile(
                path, f"sha256 {got[:16]}... does not match {CHECKSUMS_NAME} "
                f"({str(want)[:16]}...): the file is corrupt or was changed after saving "
                f"(delete {CHECKSUMS_NAME} only if you changed it on purpose)")
    return True



def check_output_dir(out_dir: str | os.PathLike, overwrite: bool,
                     flag: str = "overwrite=True") -> None:
    """Refuse `out_dir` unless it is new, or `overwrite` and it is empty or holds only a
    previous drafter's own files (OWN_FILES, config.json naming one of ARCHITECTURES).

    flag: how the caller's user asks for an overwrite (`--overwrite` on the command line).
    """
    out = Path(out_dir)
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise DrafterError(f"{out}: already exists (pass {flag} to replace a previous export)")
    if out.is_symlink() or not out.is_dir():
        raise DrafterError(f"{out}: is not a directory; refusing to replace it")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    foreign = [n for n in entries if n not in OWN_FILES or not (out / n).is_file()]
    config = out / CONFIG_NAME
    if not foreign and config.is_file():
        try:
            architectures = json.loads(config.read_text()).get("architectures") or []
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
            architectures = []
        if set(ARCHITECTURES.values()) & set(architectures):
            return
    shown = ", ".join(entries[:6]) + (f", ... ({len(entries)} entries)"
                                      if len(entries) > 6 else "")
    raise DrafterError(f"{out}: holds {shown}, not only a previous DFlash export; refusing to "
                       "replace it (remove it yourself or pick another directory)")


def current_umask() -> int:
    """The process's umask, read without changing it where the kernel reports it."""
    try:  # Linux >= 4.7 lists it in /proc/self/status
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    # Elsewhere the only way to read it is to set it: set the strictest mask and restore at
    # once, so a file another thread creates in between is at worst too private.
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def new_file_modes() -> tuple[int, int]:
    """(file, directory) permission bits the user's umask gives a newly created file and
    directory (0644 / 0755 under umask 022). The temp dir and safetensors' file are
    private (0700 / 0600) whatever the umask; a server running as another user or in a
    container must be able to read an export, so its files get these instead."""
    mask = current_umask()
    return 0o666 & ~mask, 0o777 & ~mask


def write_dir_atomically(
    out_dir: Path, write: Callable[[Path], None], overwrite: bool
) -> Path:
    """Write into a sibling temp dir, then rename it into place: a crash never leaves a
    half-written drafter at `out_dir`. Only a directory check_output_dir accepts is
    replaced. The directory and its files get the modes the umask gives new ones
    (new_file_modes), set before the rename, so the published directory is never private."""
    check_output_dir(out_dir, overwrite)
    make_parent(out_dir)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as e:
        raise unwritable(out_dir, e) from e
    try:
        write(tmp)
        file_mode, dir_mode = new_file_modes()
        for file in tmp.iterdir():
            _seal(file, file_mode)
        os.chmod(tmp, dir_mode)
        if not out_dir.exists():
            os.replace(tmp, out_dir)
        elif _exchange(tmp, out_dir):
            shutil.rmtree(tmp)  # now the previous drafter
        else:  # no atomic swap here: a crash between the renames leaves no `out_dir`
            old = out_dir.parent / f".{out_dir.name}.old-{tmp.name}"
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise unwritable(out_dir, e) from e
        raise
    return out_dir


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap the entries `a` and `b` in one step (Linux renameat2 RENAME_EXCHANGE), so that
    replacing a directory never passes through a moment without one; False where the C
    library or the filesystem offers no such swap."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def write_file_atomically(out: Path, write: Callable[[Path], None]) -> Path:
    """Write `out` through a sibling temp file renamed into place: a crash or an error never
    leaves a half-written file at `out` (a previous one stays as it was until the rename).
    The caller decides beforehand whether `out` may be replaced. The file gets the mode the
    umask gives new files (new_file_modes), as write_dir_atomically's files do."""
    make_parent(out)
    try:
        handle, name = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    except OSError as e:
        raise unwritable(out, e) from e
    os.close(handle)
    tmp = Path(name)
    try:
        write(tmp)
        _seal(tmp, new_file_modes()[0])
        os.replace(tmp, out)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise unwritable(out, e) from e
        raise
    return out


def make_parent(out: Path) -> None:
    """Create the directory `out` goes in, refusing a path through a file by name."""
    existing = next(p for p in (out.parent, *out.parent.parents) if p.exists())
    if not existing.is_dir():
        raise DrafterError(f"{out}: {existing} is a file, not a directory; choose another "
                           "output path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise unwritable(out, e) from e


def unwritable(out: Path, e: OSError) -> DrafterError:
    """A write the OS refused (read-only filesystem, no space, no permission), as one line;
    nothing was published at `out`."""
    where = f" ({e.filename})" if e.filename else ""
    return DrafterError(f"{out}: cannot write it: {e.strerror or e}{where}; nothing was "
                        "written there; choose another output path")


def _seal(file: Path, mode: int) -> None:
    """Give a written file its published mode and flush it to disk, before the rename that
    publishes it."""
    with open(file, "rb") as handle:
        os.fchmod(handle.fileno(), mode)
        os.fsync(handle.fileno())
