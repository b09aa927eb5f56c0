"""Everything a training run holds before its first step, in two stages. `build_run` opens
the run in the order a reader expects: where it runs, its directory (new, or resumed from a
checkpoint), its data, its drafter. `assemble_run` then puts a drafter and its data together
into a `Run` (the optimiser and schedule, its position) without touching a file: all a test
or a benchmark needs to drive `train.loop.train_step`. Last, build_run restores a resumed
run's position and gives rank 0 its log and progress bar.

Every refusal a run can meet before training (a directory holding another run, a changed
setting on resume, nothing to train on, a store of another target) happens in build_run, on
every rank, before rank 0 writes anything but the lock. Never takes a training step.
"""

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_train.devices import native_bf16, resolve_device
from dflash_train.drafter import DFlashDrafter
from dflash_train.run_layout import CHECKPOINTS, CONFIG, LOG, SKIPPED, TENSORBOARD
from dflash_train.run_reader import read_provenance
from dflash_train.store_schema import Store, StoreError
from dflash_train.store_schema.errors import one_line
from dflash_train.store_schema.integrity import SKIP_HINT
from dflash_train.store_schema.stats import store_stats
from dflash_train.train.best import mark_best
from dflash_train.train.checkpoint import (
    TrainCheckpoint,
    TrainState,
    check_provenance,
    restore_trainer,
)
from dflash_train.train.config import OptimConfig, TrainConfig, resolve_chunk_blocks, to_toml
from dflash_train.train.data import StoreLoader
from dflash_train.train.drafter_shape import (
    initial_drafter,
    most_frequent_labels,
    new_drafter,
    shape_conflicts,
)
from dflash_train.train.errors import TrainError
from dflash_train.train.loader_config import weights_text
from dflash_train.train.optimizer import build_optimizer
from dflash_train.train.options import option_name
from dflash_train.train.parallel import (
    barrier,
    gather_objects,
    load_optimizer_state,
    parallel_mode,
    wrap,
)
from dflash_train.train.rundir import (
    check_new_run_dir,
    check_resume_config,
    check_same_plan,
    find_resume_point,
    set_aside,
    set_aside_leftovers,
)
from dflash_train.train.sinks import NullLog, RunLog, Sinks, SkipLedger, progress_bar
from dflash_train.train.validation import Validation, open_validation

Echo = Callable[[str], None]


def use_bf16(precision: str, device: torch.device) -> bool:
    """Whether the forward runs under bf16 autocast (and the target head is kept in bf16):
    asked for, or left to `auto` where bf16 matmuls run natively (CUDA, a CPU with AMX or
    AVX-512 BF16: devices.native_bf16); elsewhere float32, which emulated bf16 would slow."""
    return precision == "bf16" or (precision == "auto" and native_bf16(device) is not None)


def head_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype the target's embedding and lm_head rows are kept in: bf16 exactly where the
    forward runs under bf16 autocast (use_bf16), else float32."""
    return torch.bfloat16 if use_bf16(precision, device) else torch.float32


def precision_note(precision: str, device: torch.device) -> str | None:
    """The run's first lines say what `auto` chose and why; None for an explicit choice."""
    if precision != "auto":
        return None
    native = native_bf16(device)
    if native is None:
        return (f"precision: fp32 (run.precision=auto: {device.type} has no native bf16 "
                "matmul)")
    return (f"precision: bf16 autocast (run.precision=auto: {native} runs bf16 matmuls "
            "natively; --set run.precision=fp32 for float32)")


@dataclass
class AlreadyComplete:
    """A --resume found the run finished: nothing is built, trained or written."""

    step: int
    checkpoint: Path


@dataclass(frozen=True)
class Placement:
    """Which process of a run this is, and the device it trains on."""

    device: torch.device
    rank: int = 0
    world: int = 1
    """Processes training together (torchrun's WORLD_SIZE); DDP / FSDP average over them."""


@dataclass(kw_only=True)
class Run:
    """A run ready for its next step; `state` is where it is and moves with every step.
    `train_step` reads the fields down to `layer_rms`; the loop around it the rest."""

    cfg: TrainConfig
    placement: Placement
    bf16: bool
    """The forward under bf16 autocast (use_bf16)."""
    model: DFlashDrafter
    """The drafter itself: what is saved, and what owns the target head."""
    forward: torch.nn.Module
    """What the forward is called on: `model` wrapped for DDP / FSDP (or `model` itself)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: TrainState
    total_steps: int
    """Steps the run takes: the learning-rate schedule spans them; the last logs accuracy."""
    layer_rms: torch.Tensor | None
    """Per context layer RMS that relative noise scales by (None: absolute or no noise)."""
    loader: StoreLoader | None = None
    """The batches the loop trains on; None for a run handed its batches one at a time."""
    run_dir: Path | None = None
    """checkpoints/, log.jsonl, config.toml; None for a run in memory, never saved."""
    sinks: Sinks = field(default_factory=Sinks)
    """Where the loop's records go; ones that do nothing unless build_run opened them."""
    validation: Validation | None = None
    """The stores the drafter is replayed on at every checkpoint (--val-store); None: none."""
    _last_epoch_batches: int | None = field(default=None, init=False, repr=False)

    def at_last_step(self) -> bool:
        """Whether the run has taken its last step (its last epoch may hold fewer batches
        than its first, so the step count alone cannot tell)."""
        def last_epoch_batches() -> int:
            if self._last_epoch_batches is None:
                self._last_epoch_batches = self.loader.batches_per_epoch(
                    self.cfg.optim.epochs - 1)
            return self._last_epoch_batches

        if self.loader is None:
            return self.state.step >= self.total_steps
        return run_finished(self.state, self.cfg.optim.epochs, self.total_steps,
                            last_epoch_batches)

    @property
    def pad_blocks_to(self) -> int:
        """Blocks per sequence rounded up to a multiple of this (few shapes for compiled
        kernels)."""
        return self.cfg.run.pad_blocks_to or (32 if self.placement.device.type == "cuda" else 1)

    @property
    def store(self) -> Store:
        return self.loader.stores[0]


def assemble_run(cfg: TrainConfig, model: DFlashDrafter, *, placement: Placement,
                 total_steps: int, loader: StoreLoader | None = None,
                 layer_rms: torch.Tensor | None = None, run_dir: Path | None = None,
                 validation: Validation | None = None) -> Run:
    """A run of `model` (its target head attached) as `cfg` configures it, at step 0, with
    sinks that do nothing, touching no file: the drafter set to train on the placement's
    device and wrapped for its ranks, the optimiser and the learning-rate schedule over
    `total_steps` built. `loader` is where the loop reads batches (and what checkpoints
    record the plan of); `layer_rms` scales relative noise (noise_layer_rms); `validation`
    measures the drafter at every checkpoint (open_validation)."""
    device = placement.device
    model.to(device)
    model.gradient_checkpointing = cfg.run.gradient_checkpointing
    model.chunk_blocks = resolve_chunk_blocks(cfg.run, device.type == "cuda")
    model.train()
    # Wrap before the optimiser exists: FSDP2 replaces the parameters with sharded ones.
    mode = parallel_mode(placement.world, cfg.run.fsdp)
    forward = wrap(model, mode, device)
    # DDP's ranks hold whole, equal gradients: Muon shares out its iterations among them
    ranks, rank = (placement.world, placement.rank) if mode == "ddp" else (1, 0)
    optimizer = build_optimizer(model, cfg.optim, ranks=ranks, rank=rank)
    return Run(cfg=cfg, placement=placement, bf16=use_bf16(cfg.run.precision, device),
               model=model, forward=forward, optimizer=optimizer,
               scheduler=_scheduler(optimizer, cfg.optim, total_steps),
               state=TrainState(plan=loader.plan_inputs() if loader is not None else []),
               total_steps=total_steps, layer_rms=layer_rms, loader=loader, run_dir=run_dir,
               validation=validation)


def build_run(cfg: TrainConfig, resume: bool, echo: Echo = print) -> Run | AlreadyComplete:
    """The run `cfg` describes, new or (`resume`) continued from its newest whole checkpoint."""
    placement = _placement(cfg)
    say = echo if placement.rank == 0 else _silent  # rank 0 tells what every rank does
    note = precision_note(cfg.run.precision, placement.device)
    if note:
        say(note)
    run_dir = Path(cfg.run.out_dir)
    torch.manual_seed(cfg.run.seed)
    point = _claim_run_dir(run_dir, cfg, resume, placement, say)
    loader, total_steps = _open_data(cfg, placement, say)
    if point is not None:
        # another store first: its parts differ too, which the plan check would blame on
        # extraction finishing or damage
        check_provenance(point.provenance, loader.stores[0].meta, loader.stores[0].url,
                         str(point.path), same_data=True)
        done = TrainState(**point.trainer["state"])
        check_same_plan(done.plan, loader.plan_inputs(), point.path)
        last = cfg.optim.epochs - 1
        if run_finished(done, cfg.optim.epochs, total_steps,
                        lambda: loader.batches_per_epoch(last)):
            if cfg.validation.stores and placement.rank == 0:
                # a crash between the last save and its marking left best.json stale
                mark_best(run_dir, done, cfg.validation.best_figure)
            return AlreadyComplete(done.step, point.path)
    model = _drafter(cfg, point, loader.stores, placement, say)
    validation = open_validation(cfg.validation, loader.stores, loader.parts, model.config,
                                 placement.rank, placement.world, say,
                                 skip_corrupt=cfg.loader.skip_corrupt)
    run = assemble_run(cfg, model, placement=placement, total_steps=total_steps, loader=loader,
                       layer_rms=noise_layer_rms(cfg, loader, placement.device), run_dir=run_dir,
                       validation=validation)
    if point is not None:
        _restore(point, run)
        say(f"resumed from {point.path} (step {run.state.step}, epoch {run.state.epoch})")
        if validation is not None and placement.rank == 0:
            # a crash between a save and its marking, or a damaged best stepped over
            mark_best(run_dir, run.state, cfg.validation.best_figure)
    # The optimizer holds its state now: the checkpoint as read (trainer.pt with a second
    # copy of the Adam moments) is let go when this returns, before the first step.
    if placement.rank == 0:
        _write_config(run_dir, to_toml(cfg))
    run.sinks = rank_sinks(run, echo)
    for damage in loader.damage:  # found before reading: whole parts never enter the plan
        run.sinks.skipped.record(damage, run.state.step)
    return run


def rank_sinks(run: Run, echo: Echo) -> Sinks:
    """This rank's sinks in the run directory: rank 0 logs (log.jsonl, and TensorBoard when
    asked) and shows the progress bar, the other ranks' do nothing; every rank lists the
    damaged samples it skipped in the one ledger."""
    rank, out, settings = run.placement.rank, run.run_dir, run.cfg.run
    log = RunLog(out / LOG, out / TENSORBOARD if settings.tensorboard else None) \
        if rank == 0 else NullLog()
    return Sinks(log=log, bar=progress_bar(run.total_steps, run.state.step,
                                           rank == 0 and settings.progress),
                 skipped=SkipLedger(out / SKIPPED, rank, echo))


def _silent(_: str) -> None:
    pass


def _placement(cfg: TrainConfig) -> Placement:
    """This process's rank, the world size and the device it trains on."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0")) if world > 1 else 0
    device = resolve_device(cfg.run.device, TrainError, rank)
    if device.type == "cuda":
        # NCCL object collectives (the resume agreement) place buffers on the current device
        torch.cuda.set_device(device)
    elif cfg.run.attention == "flex":
        raise TrainError(f"run.attention flex trains on CUDA only (flex_attention has no "
                         f"backward on {device.type}); use split or dense")
    _join_ranks(world, device)
    return Placement(device=device, rank=rank, world=world)


def _join_ranks(world: int, device: torch.device) -> None:
    """torchrun's process group, by the device trained on, not by what the host has: NCCL
    holds no CPU tensor, so CPU training on a GPU host needs gloo too."""
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def _claim_run_dir(run_dir: Path, cfg: TrainConfig, resume: bool, placement: Placement,
                   say: Echo) -> TrainCheckpoint | None:
    """The run directory: a new run never mixes into an old one; a resume continues the run
    it finds exactly as configured (rundir.RUN_MANAGEMENT_FIELDS aside), from the newest
    checkpoint that reads whole. Every rank checks before rank 0 writes anything."""
    point = _resume_point(run_dir, cfg, placement, say) if resume else None
    if point is None:
        check_new_run_dir(run_dir)
        moved = set_aside_leftovers(run_dir) if placement.rank == 0 else None
        if moved:
            say(f"note: {run_dir} holds a run that stopped before its first complete "
                f"checkpoint; moved its {', '.join(moved[0])} to {moved[1]} and starting a "
                "new run")
    barrier(placement.world)
    return point


def _resume_point(run_dir: Path, cfg: TrainConfig, placement: Placement,
                  say: Echo) -> TrainCheckpoint:
    """The checkpoint a resume continues from, the same on every rank, its config checked
    against cfg; damaged newer ones are named and (rank 0, once every rank has chosen)
    renamed out of rotation."""
    try:
        point, failure = find_resume_point(run_dir), None
    except Exception as e:  # told to the other ranks first, so that none waits forever
        point, failure = None, e
    choice = point.path.name if point is not None else f"none ({type(failure).__name__})"
    check_same_choice(gather_objects(choice, placement.world), run_dir)
    if failure is not None:
        raise failure
    check_resume_config(point, cfg)
    barrier(placement.world)
    for path, reason in point.damaged:
        aside = set_aside(path) if placement.rank == 0 else path
        say(f"note: {reason}; resuming from the previous complete checkpoint "
            f"{point.path.name} instead (the damaged one is kept as {aside})")
    return point


def check_same_choice(choices: list[str], run_dir: Path) -> None:
    """Refuse a resume whose ranks chose different checkpoints (one rank read a file as
    damaged that another read whole): they would continue from different steps."""
    if len(set(choices)) > 1:
        named = ", ".join(f"rank {r}: {c}" for r, c in enumerate(choices))
        raise TrainError(f"--resume: the ranks chose different checkpoints under "
                         f"{run_dir / CHECKPOINTS} ({named}); check that every rank sees the "
                         "same files, then resume again")


def _open_data(cfg: TrainConfig, placement: Placement, say: Echo) -> tuple[StoreLoader, int]:
    """The loader (a deterministic plan over complete parts; this rank reads only its
    share) and the steps the run takes. On CUDA batches are padded to few shapes, so
    compiled flex attention does not recompile often."""
    cuda = placement.device.type == "cuda"
    loader_cfg = replace(cfg.loader, pad_to=cfg.loader.pad_to if not cuda or
                         cfg.loader.pad_to > 1 else 256)
    loader = StoreLoader(cfg.stores, loader_cfg, rank=placement.rank, world=placement.world)
    _announce_unfinished(loader, say)
    if not loader.has_trainable_block():
        raise TrainError(_nothing_to_train(cfg))
    total_steps = loader.batches_per_epoch() * cfg.optim.epochs
    if cfg.optim.max_steps is not None:
        total_steps = min(total_steps, cfg.optim.max_steps)
    if total_steps == 0:
        raise TrainError(f"{option_name('loader.store_weights')} "
                         f"{weights_text(cfg.loader.store_weights or [])} draws no sample in "
                         "epoch 0: nothing to train on; raise the weights")
    return loader, total_steps


def _announce_unfinished(loader: StoreLoader, say: Echo) -> None:
    """One line naming the parts left out because extraction has not finished them."""
    named = [f"{s.url} part(s) {', '.join(map(str, parts))}" for s in loader.stores
             if (parts := s.unfinished_parts())]
    if named:
        say(f"leaving out unfinished parts (extraction still running or stopped; training "
             f"on complete parts only): {'; '.join(named)}")


def _nothing_to_train(cfg: TrainConfig) -> str:
    where = ", ".join(cfg.stores)
    if cfg.loader.max_length:
        return (f"{option_name('loader.max_length')} {cfg.loader.max_length} leaves nothing "
                f"to train on in {where}: no sample has a trainable block (two consecutive "
                "loss-mask tokens after the first) within its first "
                f"{cfg.loader.max_length} tokens; raise it")
    return (f"nothing to train on in {where}: no sample has a trainable block (two "
            "consecutive loss-mask tokens after the first)")


def run_finished(done: TrainState, epochs: int, total_steps: int,
                 last_epoch_batches: Callable[[], int]) -> bool:
    """Whether a position is the end of the run (its last epoch's last batch may have been
    saved before the epoch counter moved on); last_epoch_batches() counts that epoch's."""
    last = epochs - 1
    return (done.step >= total_steps or done.epoch > last
            or (done.epoch == last and done.batch_in_epoch >= last_epoch_batches()))


def _drafter(cfg: TrainConfig, point: TrainCheckpoint | None, stores: list[Store],
             placement: Placement, say: Echo) -> DFlashDrafter:
    """The drafter the run trains, borrowing the store's frozen embed_tokens / lm_head (on
    the placement's device, in bf16 where the forward runs in it)."""
    rows = stores[0].target_rows()
    model = _starting_drafter(cfg, point, stores[0])
    if point is None and not cfg.model.init_from and model.config.draft_vocab_size:
        start = time.perf_counter()
        ids, covered = most_frequent_labels(stores, model.config.draft_vocab_size)
        model.set_draft_vocab(ids)
        say(f"draft vocabulary: the {ids.numel():,} most frequent of "
            f"{model.config.vocab_size:,} ids cover {covered:.2%} of the train stores' "
            f"labels (counted in {time.perf_counter() - start:.1f} s)")
    if cfg.run.fsdp and model.config.kind == "dflash2":
        # The selector term reads the selector's weights outside the forward, where FSDP2
        # has not gathered them.
        raise TrainError("run.fsdp does not train a DFlash 2 drafter yet; use DDP (drop "
                         "--fsdp)")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    say(f"drafter: {model.config.describe()}; {parameter_count(trainable)} trainable "
        "parameters")
    device = placement.device
    rows_dtype = head_dtype(cfg.run.precision, device)
    model.attach_target_head(rows["embed_tokens"].to(device, rows_dtype),
                             rows["lm_head"].to(device, rows_dtype))
    return model


def _starting_drafter(cfg: TrainConfig, point: TrainCheckpoint | None,
                      store: Store) -> DFlashDrafter:
    """A resume trains the checkpoint's own drafter, as its config.json describes it:
    defaults that resolve differently today (rundir.config_changes) must not build another
    one. Else the one model.init_from names, else a new one for the store's target."""
    if point is not None:  # its store checked in build_run
        return point.drafter
    if not cfg.model.init_from:
        return new_drafter(cfg, store)
    model = initial_drafter(cfg.model)
    conflicts = shape_conflicts(cfg.model, model.config)
    if conflicts:
        raise TrainError(f"model.init_from {cfg.model.init_from} fixes the drafter's shape; "
                         f"these settings differ from it: {'; '.join(conflicts)}")
    init_meta = read_provenance(cfg.model.init_from)
    if init_meta is not None:
        check_provenance(init_meta, store.meta, store.url, cfg.model.init_from)
    return model


def parameter_count(n: int) -> str:
    """An honest count: exact below a million, else millions or billions to 3 digits."""
    if n < 10**6:
        return f"{n:,}"
    if n < 10**9:
        return f"{n / 1e6:.3g}M"
    return f"{n / 1e9:.3g}B"


def noise_layer_rms(cfg: TrainConfig, loader: StoreLoader, device: torch.device
                    ) -> torch.Tensor | None:
    """The first store's per-layer context RMS, for noise relative to it (else None). Over
    the parts the loader checked and found sound (its check is not repeated); a shard
    failing its checksum is refused here too, or, when skipping, left out."""
    if cfg.noise.kind == "none" or cfg.noise.absolute:
        return None
    store = loader.stores[0]
    damaged_parts = {d.part for d in loader.damage if d.store == store.url}
    sound = [p.index for i, p in loader.parts if i == 0 and p.index not in damaged_parts]
    try:
        stats = store_stats(store, skip_damaged=cfg.loader.skip_corrupt, checked_parts=sound,
                            max_tokens=cfg.noise.stats_max_tokens)
    except StoreError as e:  # unreadable context; skipping steps around it, as in reading
        if cfg.loader.skip_corrupt:  # already skipping: nothing sound is left to read
            raise StoreError(f"{e}, even skipping the damaged samples ({SKIP_HINT} is on); "
                             f"run `dflash store validate {store.url}` and extract the "
                             "damaged parts again") from e
        raise StoreError(f"{e}; pass {SKIP_HINT} to skip the damaged samples") from e
    return torch.tensor(stats.rms, device=device)


def _scheduler(optimizer, optim: OptimConfig, total_steps: int):
    """Linear warmup over optim.warmup_ratio of the run, then cosine to min_lr_ratio."""
    warmup = max(1, round(optim.warmup_ratio * total_steps))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(total_steps, warmup, optim.min_lr_ratio))


def _lr_lambda(total: int, warmup: int, min_ratio: float):
    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return scale


def _restore(point: TrainCheckpoint, run: Run) -> None:
    """The checkpoint's position, schedule, RNG and optimiser state, restored into `run`."""
    state, optimizer_state = restore_trainer(point.trainer, run.scheduler)
    state.plan = run.state.plan  # checked equal above; recorded again by checkpoints before it was
    try:
        load_optimizer_state(run.model, run.optimizer, optimizer_state)
    except (RuntimeError, ValueError, KeyError) as e:
        raise TrainError(f"{point.path}: its optimizer state does not fit this drafter "
                         f"({one_line(e)})") from e
    run.state = state


def _write_config(run_dir: Path, config_toml: str) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG).write_text(config_toml)
    except OSError as e:
        raise TrainError(f"--out {run_dir}: cannot write the run directory: {e}") from e
