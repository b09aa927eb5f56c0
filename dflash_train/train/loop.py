"""The training loop: store -> batches -> blocks -> noised fc input -> drafter -> loss -> step.

Reads top to bottom: build the run (train.run), then one step per batch, epoch after epoch:
step, validation (on a checkpoint step), record, health, checkpoint. `train_step` needs only
a Run (train.run.assemble_run makes one in memory) and a batch. Everything random is keyed
by (seed, epoch, sample), so a resumed run continues bit-for-bit and W ranks train what one
process trains; validation draws nothing from the training RNG.
"""

import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_train.run_layout import checkpoint_dir
from dflash_train.run_reader import RunDirError, read_best
from dflash_train.train.batch import Batch, empty_batch
from dflash_train.train.best import mark_best
from dflash_train.train.checkpoint import (
    CheckpointContents,
    latest_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from dflash_train.train.config import TrainConfig, to_toml
from dflash_train.train.errors import TrainError
from dflash_train.train.health import StepHealth
from dflash_train.train.noise import noise_std_at
from dflash_train.train.parallel import barrier, full_states, global_norm, sum_over_ranks
from dflash_train.train.record import StepRecord, ValidationFigures
from dflash_train.train.run import AlreadyComplete, Run, build_run
from dflash_train.train.rundir import local_paths_absolute, run_lock
from dflash_train.train.step import batch_accuracy, block_loss, make_blocks, noised_context
from dflash_train.train.validation import follow_best, patience_spent


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    checkpoint: Path
    run_dir: Path
    skipped: int = 0
    """Distinct damaged samples (or parts) this process skipped (loader.skip_corrupt)."""
    already_complete: bool = False
    """A --resume found the run finished: nothing was trained or written."""
    stopped: str | None = None
    """Why the run stopped before its last step (run.patience), else None."""
    trained: int = 0
    """Steps this call took: 0 for a resumed run that run.patience had stopped already."""


def train(cfg: TrainConfig, resume: bool = False, echo=print) -> TrainResult:
    """Run (or resume) training as configured; returns where the final checkpoint is."""
    if not cfg.stores:
        raise TrainError("no store given: pass --store PATH")
    rank = int(os.environ.get("RANK", "0"))
    with run_lock(Path(cfg.run.out_dir), rank):
        return _train(cfg, resume, echo)


def _train(cfg: TrainConfig, resume: bool, echo) -> TrainResult:
    # recorded absolute in config.toml: a resume from another cwd names the same stores
    cfg = replace(cfg, stores=local_paths_absolute(cfg.stores), validation=replace(
        cfg.validation, stores=local_paths_absolute(cfg.validation.stores)))
    run = build_run(cfg, resume, echo)
    if isinstance(run, AlreadyComplete):
        return TrainResult(run.step, float("nan"), run.checkpoint, Path(cfg.run.out_dir),
                           already_complete=True)
    health = StepHealth(run.run_dir, run.model.config.vocab_size, cfg.optim.lr)
    sinks, last_loss, checkpoint = run.sinks, float("nan"), None
    first_step = run.state.step
    stopped = stop_early(run)  # a resumed run that run.patience had stopped already
    for batch, waited in _batches(run) if stopped is None else ():
        batch = batch if batch is not None else empty_batch(run.store)
        for damage in batch.skipped:
            sinks.skipped.record(damage, run.state.step + 1)
        record = train_step(run, batch, waited)
        at_checkpoint = record.step % cfg.run.checkpoint_every == 0 or run.at_last_step()
        if at_checkpoint and run.validation is not None:
            record.validation = validate_checkpoint(run)  # every rank: the same figures
        last_loss = record.loss
        sinks.log.write(record)
        health.check(record.step, record.loss, record.grad_norm)  # every rank agrees
        sinks.bar.update(1)
        sinks.bar.set_postfix(loss=f"{record.loss:.3f}", epoch=record.epoch)
        if at_checkpoint:
            checkpoint = save_run(run)
            stopped = None if run.at_last_step() else stop_early(run)
            if stopped is not None:
                break
    return replace(_finish(run, checkpoint, last_loss, stopped),
                   trained=run.state.step - first_step)


def validate_checkpoint(run: Run) -> ValidationFigures:
    """The drafter replayed on the validation stores (train.validation), and the run's best
    so far moved to this step if it beats it. A collective under torchrun."""
    figures = run.validation.evaluate(run.model)
    follow_best(run.state, figures, run.cfg.validation)
    return figures


def stop_early(run: Run) -> str | None:
    """Why the run stops before its last step: run.patience validations in a row without a
    better one (every rank's state agrees), else None."""
    state = run.state
    if not patience_spent(state, run.cfg.run.patience):
        return None
    return (f"validation {run.cfg.validation.best_figure} has not beaten step "
            f"{state.best_step}'s {state.best_value:.4f} in {state.evaluations_since_best} "
            f"validations (run.patience {run.cfg.run.patience}); stopped at step {state.step}"
            f". --resume --set run.patience=N with a larger N trains on")


def _batches(run: Run) -> Iterator[tuple[Batch | None, float]]:
    """The run's remaining batches, epoch after epoch from where its state is, each with the
    seconds spent waiting for it; stops once the run has taken its last step. A rank with no
    sample in a step gets None (the loop trains an empty batch: collectives stay matched)."""
    state = run.state
    while state.epoch < run.cfg.optim.epochs and state.step < run.total_steps:
        batches = run.loader.epoch(state.epoch, skip_batches=state.batch_in_epoch)
        wait_start = time.perf_counter()
        for batch in batches:
            yield batch, time.perf_counter() - wait_start
            if state.step >= run.total_steps:
                return
            wait_start = time.perf_counter()
        state.epoch += 1
        state.batch_in_epoch = 0


def train_step(run: Run, batch: Batch, data_wait: float = 0.0) -> StepRecord:
    """One optimiser step on this rank's `batch`; the record's loss and gradient norm are
    the global ones, the same on every rank. Rank 0 measures the drafts' accuracy, where it
    is logged: every run.log_every steps and at the last."""
    start = time.perf_counter()
    cfg, state, model = run.cfg, run.state, run.model
    device, world = run.placement.device, run.placement.world
    blocks = make_blocks(batch, mask_token_id=model.config.mask_token_id,
                         block_size=model.config.block_size,
                         anchors_per_seq=cfg.run.anchors_per_seq, seed=cfg.run.seed,
                         epoch=state.epoch, soft_targets=cfg.loss.kind == "kl-topk",
                         pad_blocks_to=run.pad_blocks_to)
    # Labels and which slots count are fixed above from stored verifier ids; only now is
    # the context noised, on a copy that nothing but the drafter's fc reads.
    context = noised_context(batch, run.layer_rms, cfg.noise, seed=cfg.run.seed,
                             epoch=state.epoch, step=state.step, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=run.bf16):
        hidden = run.forward(context, batch.lengths.to(device), blocks.block_ids.to(device),
                             blocks.anchors.to(device), attention=cfg.run.attention)
        # The world-size scaling, both ways: DDP and FSDP average gradients over ranks, so
        # each rank's share of the global weighted sum is scaled up by W for backward (the
        # single-process gradient), and back down by W to report its share of the loss.
        loss = block_loss(hidden, blocks, model, cfg.loss,
                          global_sum=sum_over_ranks if world > 1 else None) * world
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf)
    run.optimizer.step()
    run.scheduler.step()
    state.step += 1
    state.batch_in_epoch += 1
    state.tokens_seen += int(batch.lengths.sum())
    reported = loss.detach() / world
    if world > 1:
        dist.all_reduce(reported)
    loss_value, norm = reported.item(), global_norm(grad_norm)  # the step's end on CUDA too
    tokens, step_s = int(batch.lengths.sum()), time.perf_counter() - start
    record = StepRecord(
        step=state.step, epoch=state.epoch, loss=loss_value, lr=run.scheduler.get_last_lr()[0],
        grad_norm=norm, tokens=tokens, samples=len(batch.refs), skipped=len(batch.skipped),
        blocks=int(blocks.valid.any(-1).sum()), noise_std=noise_std_at(cfg.noise, state.step - 1),
        data_wait_s=data_wait, step_s=step_s, tokens_per_s=tokens / max(1e-9, data_wait + step_s))
    if run.placement.rank == 0 and (state.step % cfg.run.log_every == 0
                                    or state.step == run.total_steps):
        record.accuracy = batch_accuracy(hidden.detach(), blocks, model)
    return record


def save_run(run: Run) -> Path | None:
    """Checkpoint the run where it is: every rank gathers (a collective under FSDP); rank 0
    writes, then marks the best checkpoint (train.best). Rotation never deletes the marked
    one: the old best is spared until the marker has moved off it. Returns the checkpoint
    on rank 0, None elsewhere."""
    model_state, optimizer_state = full_states(run.model, run.optimizer)
    path = None
    if run.placement.rank == 0:
        keep = run.cfg.run.keep_checkpoints
        contents = CheckpointContents(run.model, model_state, optimizer_state, run.scheduler,
                                      run.state, run.store.meta, to_toml(run.cfg))
        path = save_checkpoint(run.run_dir, contents, keep=keep, spare=_marked(run))
        if run.validation is not None:
            best = mark_best(run.run_dir, run.state, run.cfg.validation.best_figure)
            prune_checkpoints(run.run_dir, keep, spare=best)
    barrier(run.placement.world)
    return path


def _marked(run: Run) -> Path | None:
    """The checkpoint best.json names, which rotation spares until the marker moves; a
    marker that does not read spares the state's best instead (mark_best rewrites it)."""
    try:
        marked = read_best(run.run_dir)
    except RunDirError:
        marked = None
    if marked is not None:
        return marked.checkpoint(run.run_dir)
    best = run.state.best_step
    return None if best is None else checkpoint_dir(run.run_dir, best)


def _finish(run: Run, checkpoint: Path | None, last_loss: float,
            stopped: str | None = None) -> TrainResult:
    """The last checkpoint (unless the last step just wrote it), sinks closed, the summary."""
    run.sinks.bar.close()
    if latest_checkpoint(run.run_dir) != checkpoint_dir(run.run_dir, run.state.step):
        checkpoint = save_run(run)
    run.sinks.log.close()
    barrier(run.placement.world)
    run.sinks.skipped.summarise()
    return TrainResult(run.state.step, last_loss, checkpoint or latest_checkpoint(run.run_dir),
                       run.run_dir, run.sinks.skipped.count, stopped=stopped)
