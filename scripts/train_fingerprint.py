"""Fingerprint what `dflash train` computes, to prove a refactor changes nothing.

On a fixed synthetic store (tests/train/conftest.build_store) and a fixed seed, trains three
runs on CPU in one intra-op thread (float sums split by thread differ):
  dflash     a DFlash drafter, 12 steps over 3 epochs, logging accuracy every step,
  dflash2    a DFlash 2 drafter with factorised selector codebooks, the same schedule,
  resume     the dflash run with every checkpoint after step 4 deleted, resumed to the end,
and prints, per run, the sha256 of the final weights (name, dtype, shape and bytes of every
tensor), of the log.jsonl records without their wall-clock fields, and of each file the
final checkpoint's drafter/ holds. It fingerprints the tree it is run from (`python -m`
imports the package from the current directory): run it in each tree and diff the outputs, e.g.

    cd TREE && OMP_NUM_THREADS=1 python -m scripts.train_fingerprint > fingerprint.txt
"""

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch

from dflash_train.drafter import load_drafter
from dflash_train.drafter.config import DRAFTER_KINDS
from dflash_train.run_layout import DRAFTER_SUBDIR, LOG, checkpoint_dir
from dflash_train.train.checkpoint import complete_checkpoints
from dflash_train.train.config import load_train_config
from dflash_train.train.loop import train
from tests.train.conftest import build_store

WALL_CLOCK = ("data_wait_s", "step_s", "tokens_per_s")
"""Log fields that measure time, not computation: left out of the fingerprint."""
RESUME_FROM = checkpoint_dir(".", 4).name

SETTINGS = {"model.num_hidden_layers": 1, "loader.batch_tokens": 256, "run.anchors_per_seq": 8,
            "optim.lr": 3e-3, "optim.epochs": 3, "run.progress": False, "run.log_every": 1,
            "run.checkpoint_every": 4, "run.keep_checkpoints": 0, "loader.prefetch_batches": 0,
            "run.precision": "fp32"}
DFLASH2 = {"model.kind": "dflash2", "model.selector_rank": 8, "model.selector_top_k": 4,
           "model.selector_codebooks": "factorised"}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weights_sha(run_dir: Path) -> str:
    h = hashlib.sha256()
    checkpoint = complete_checkpoints(run_dir)[-1]
    state = load_drafter(checkpoint, kinds=DRAFTER_KINDS).state_dict()
    for name in sorted(state):
        t = state[name].contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def log_sha(run_dir: Path) -> tuple[str, int, list[str]]:
    lines = (run_dir / LOG).read_text().splitlines()  # as written: every line, raw
    records = [json.loads(line) for line in lines]
    kept = [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in records]
    return _sha(json.dumps(kept).encode()), len(records), list(records[-1])


def report(name: str, run_dir: Path) -> None:
    checkpoint = complete_checkpoints(run_dir)[-1]
    log, count, keys = log_sha(run_dir)
    print(f"{name}: weights {weights_sha(run_dir)}")
    print(f"{name}: log {log} ({count} records; keys {','.join(keys)})")
    held = sorted(p.name for p in checkpoint.iterdir())
    print(f"{name}: checkpoint {checkpoint.name} holds {held}")
    for file in sorted((checkpoint / DRAFTER_SUBDIR).iterdir()):
        print(f"{name}: drafter/{file.name} {_sha(file.read_bytes())}")
    print(f"{name}: run dir holds {sorted(p.name for p in run_dir.iterdir())}")


def run(store: str, out: Path, resume: bool = False, **extra) -> Path:
    cfg = load_train_config(None, {"stores": [store], "run.out_dir": str(out), **SETTINGS, **extra})
    train(cfg, resume=resume, echo=lambda _: None)
    return out


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        store = str(tmp / "hs.zarr")
        build_store(store)
        report("dflash", run(store, tmp / "dflash"))
        report("dflash2", run(store, tmp / "dflash2", **DFLASH2))
        resumed = tmp / "resume"
        shutil.copytree(tmp / "dflash", resumed)
        for later in complete_checkpoints(resumed):
            if later.name > RESUME_FROM:
                shutil.rmtree(later)
        report("resume", run(store, resumed, resume=True))


if __name__ == "__main__":
    main()
