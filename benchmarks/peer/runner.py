"""Train the same drafter with ours and with speculators, pinned to the same settings, measured.

`PeerSettings` is the one list of what both trainers are pinned to; `ours_flags` and
`speculators_flags` say how each spells it, and the module docstring of each says what the
other cannot match. Each run is a fresh process (ours: benchmarks.peer.measure; speculators:
benchmarks.peer.launch in its own venv) that reports its own peak RSS; training tokens/s is
tokens fed to training steps over the wall time of those steps (data waits included, start-up,
checkpointing and speculators' validation passes not).

Pinned where both expose it: drafter layers (all full attention), block size 16, the
optimizer (AdamW with betas (0.9, 0.999): speculators does not expose betas, ours is set to
torch's default, which it uses; or Muon on the matrices with AdamW on the rest, Muon's lr
adjusted to match AdamW's update RMS in both), learning rate, weight decay (speculators' Muon
group has its own, set to the same), warmup ratio + cosine decay to 0, steps, gradient clip
1.0 (speculators' is fixed), hard CE on the verifier argmax with exp(-(k-1)/gamma) or D-PACE
slot weights (alpha 0.5 in both), bf16 autocast, no noise (speculators has none), seed.
A reduced draft vocabulary is ours only: convert.py refuses speculators' (its d2t is not
read by our loader), and its own guide prefers the full vocabulary for DFlash.

Not the same by construction:
- batches: ours pads samples to the longest (`batch_tokens` = samples x longest), grouping
  samples of similar length (PeerSettings.grouping: by_length); speculators packs
  samples into one row of `batch_tokens` (its --total-seq-len), so a step of ours holds
  somewhat fewer real tokens; both counts are reported.
- anchors: ours samples `anchors_per_seq` per sample; speculators `--max-anchors` per packed
  row, so it gets anchors_per_seq x (samples a row holds on average); its padded anchor
  blocks cost compute either way. Our anchors need tokens a and a+1 in the loss mask, its
  any loss-mask token but the row's last 16.
- validation: speculators always holds out a share of the dataset (--train-data-ratio < 1):
  it is set to leave out one sample; ours trains on every sample.
"""

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from benchmarks.peer.verifier import EXPECTED_HEAD

REPO = Path(__file__).resolve().parents[2]


@dataclass
class PeerSettings:
    """What both trainers are pinned to."""

    steps: int = 20
    """Optimiser steps."""
    lr: float = 6e-3
    """Peak learning rate."""
    layers: int = 1
    """Drafter decoder layers, all full attention."""
    anchors_per_seq: int = 16
    """Blocks per sample per step (speculators: times the samples one packed row holds)."""
    batch_tokens: int = 2048
    """Ours: padded tokens per batch; speculators: its packed row length (--total-seq-len)."""
    gamma: float = 10.0
    """Slot weight decay length, exp(-(k-1)/gamma) (position_weights "decay" only)."""
    position_weights: Literal["decay", "dpace"] = "decay"
    """Slot weights: decay over gamma, or D-PACE (speculators' DFlash default)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """AdamW, or Muon on the drafter's matrices (speculators' default)."""
    draft_vocab_size: int | None = None
    """Ours only: model.draft_vocab_size (None: the target's whole vocabulary)."""
    warmup_ratio: float = 0.04
    """Share of the steps warming up linearly, then cosine decay to 0."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    precision: Literal["bf16", "fp32"] = "bf16"
    """Autocast dtype of both (speculators' --hidden-states-dtype)."""
    seed: int = 0
    """Seed of weights, data order and anchors (each its own way)."""
    threads: int | None = None
    """torch threads of each run (OMP_NUM_THREADS); None: torch's default."""
    grouping: Literal["random", "by_length"] = "by_length"
    """Ours: how samples form batches (loader.grouping); by_length comes closest to the
    real tokens per step speculators' packing gives (random, our default, pads ~40 %)."""

    def __post_init__(self):
        if self.position_weights != "decay" and self.gamma != 10.0:
            raise ValueError(f"gamma {self.gamma} acts only with position_weights 'decay', "
                             f"not {self.position_weights!r}")


@dataclass
class Measured:
    """One training run, as measured."""

    trainer: str
    steps: int
    train_tokens: int
    train_seconds: float
    peak_rss_mib: float
    wall_seconds: float
    checkpoint: str
    """The trained drafter directory as the trainer wrote it."""

    @property
    def tokens_per_s(self) -> float:
        return self.train_tokens / max(self.train_seconds, 1e-9)


def ours_flags(store: str, run_dir: str, s: PeerSettings) -> list[str]:
    flags = ["--store", store, "--out", run_dir, "--max-steps", str(s.steps), "--epochs",
             "1000000", "--lr", repr(s.lr), "--batch-tokens", str(s.batch_tokens),
             "--loss", "ce", "--noise", "none",
             "--anchors-per-seq", str(s.anchors_per_seq), "--layers", str(s.layers),
             "--device", "cpu", "--seed", str(s.seed), "--no-progress",
             "--set", "optim.betas=0.9,0.999", "--set", f"optim.warmup_ratio={s.warmup_ratio}",
             "--set", f"optim.weight_decay={s.weight_decay}", "--set", "optim.min_lr_ratio=0",
             "--set", "optim.grad_clip=1.0", "--set", f"run.precision={s.precision}",
             "--set", "model.sliding_layers=0", "--set", f"run.checkpoint_every={s.steps}",
             "--set", f"run.log_every={s.steps}", "--set", f"loader.grouping={s.grouping}",
             "--set", f"optim.optimizer={s.optimizer}",
             "--set", f"loss.position_weights={s.position_weights}"]
    if s.position_weights == "decay":  # our loss refuses a gamma that would not act
        flags += ["--gamma", repr(s.gamma)]
    if s.draft_vocab_size is not None:
        flags += ["--set", f"model.draft_vocab_size={s.draft_vocab_size}"]
    return flags


def speculators_flags(data_dir: str, save_path: str, target: str, layer_ids: list[int],
                      mask_token_id: int, samples: int, mean_length: float,
                      s: PeerSettings) -> list[str]:
    """`layer_ids` in speculators' numbering (writer.speculators_layer_ids)."""
    per_row = max(1.0, s.batch_tokens / mean_length)
    # epochs enough for the steps (its train split, packed, is at least this many rows per
    # epoch); launch.py stops it at --max-steps exactly
    rows = max(1, math.floor((samples - 1) * mean_length / s.batch_tokens))
    flags = ["--speculator-type", "dflash", "--verifier-name-or-path", target,
             "--data-path", data_dir, "--save-path", save_path,
             "--log-dir", str(Path(save_path) / "logs"),
             "--target-layer-ids", *map(str, layer_ids), "--mask-token-id", str(mask_token_id),
             "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
             "--num-layers", str(s.layers),
             "--full-attention-indices", *map(str, range(s.layers)),
             "--block-size", "16", "--loss-fn", "ce",
             "--max-anchors", str(max(1, round(s.anchors_per_seq * per_row))),
             "--total-seq-len", str(s.batch_tokens),
             "--optimizer", s.optimizer, "--lr", repr(s.lr),
             "--weight-decay", repr(s.weight_decay),
             "--scheduler-type", "cosine", "--scheduler-warmup-ratio", repr(s.warmup_ratio),
             "--max-steps", str(s.steps), "--epochs", str(math.ceil(s.steps / rows) + 1),
             "--train-data-ratio", repr(1 - 0.5 / samples),
             "--hidden-states-dtype", "bfloat16" if s.precision == "bf16" else "float32",
             "--num-workers", "0", "--seed", str(s.seed)]
    if s.position_weights == "decay":
        flags += ["--per-position-loss-weight", "fixed-exp-decay",
                  "--dflash-decay-gamma", repr(s.gamma)]
    else:
        flags += ["--per-position-loss-weight", "dpace", "--dpace-alpha", "0.5"]
    if s.optimizer == "muon":
        flags += ["--muon-weight-decay", repr(s.weight_decay),
                  "--muon-adjust-lr-fn", "match_rms_adamw"]
    return flags


def _env(s: PeerSettings, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), **extra)
    if s.threads:
        env["OMP_NUM_THREADS"] = str(s.threads)
    return env


def _run(cmd: list[str], log: Path, s: PeerSettings, **env: str) -> None:
    with open(log, "w") as out:
        done = subprocess.run(cmd, cwd=REPO, env=_env(s, **env), stdout=out,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"{cmd[2]} failed (exit {done.returncode}); the end of {log}:\n"
                         + "\n".join(tail))


def run_ours(store: str, work: Path, s: PeerSettings) -> Measured:
    from dflash_train.train.checkpoint import latest_checkpoint
    from dflash_train.train.log_summary import read_log

    run_dir = work / "ours-run"
    report = work / "ours-measure.json"
    _run([sys.executable, "-m", "benchmarks.peer.measure", str(report), "--",
          *ours_flags(store, str(run_dir), s)], work / "ours-train.log", s)
    steps = read_log(run_dir)
    measured = json.loads(report.read_text())
    return Measured("dflash-train", len(steps), sum(r.tokens for r in steps),
                    sum(r.step_s + r.data_wait_s for r in steps),
                    measured["peak_rss_kb"] / 1024, measured["wall_seconds"],
                    str(latest_checkpoint(run_dir)))


def run_speculators(python: Path, data_dir: str, verifier: Path, layer_ids: list[int],
                    mask_token_id: int, samples: int, mean_length: float, work: Path,
                    s: PeerSettings) -> Measured:
    """`verifier`: a directory benchmarks.peer.verifier wrote (its head is checked)."""
    save_path = work / "speculators-run"
    report = work / "speculators-measure.json"
    flags = speculators_flags(data_dir, str(save_path), str(verifier), layer_ids,
                              mask_token_id, samples, mean_length, s)
    _run([str(python), "-m", "benchmarks.peer.launch", str(report), "--", *flags],
         work / "speculators-train.log", s,
         DFLASH_PEER_EXPECTED_HEAD=str(verifier / EXPECTED_HEAD))
    measured = json.loads(report.read_text())
    epochs = sorted(int(p.name) for p in save_path.iterdir() if p.name.isdigit())
    return Measured("speculators", measured["steps"], measured["train_tokens"],
                    measured["train_seconds"], measured["peak_rss_kb"] / 1024,
                    measured["wall_seconds"], str(save_path / str(epochs[-1])))
