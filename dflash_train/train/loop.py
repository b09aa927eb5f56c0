"""The training loop: store -> batches -> blocks -> noised fc input -> drafter -> loss -> step.

Reads top to bottom: set up (distributed, device, data, drafter, optimiser, resume), then one
loop over epochs and batches, logging and checkpointing as it goes. Everything random is keyed
by (seed, epoch, sample), so a resumed run continues bit-for-bit and W ranks train what
one process trains.
"""

import json
import math
import os
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from dflash_train.blocks import draft_topk
from dflash_train.devices import resolve_device
from dflash_train.drafter import (
    AttentionShape,
    DFlashDrafter,
    DrafterConfig,
    DrafterError,
    load_drafter,
    published_attention,
)
from dflash_train.drafter.config import DRAFTER_KINDS
from dflash_train.drafter.model import dflash2_from
from dflash_train.evaluate.metrics import AcceptanceStats
from dflash_train.store_schema import Store, StoreError
from dflash_train.store_schema.errors import one_line
from dflash_train.store_schema.integrity import SKIP_HINT
from dflash_train.store_schema.stats import store_stats
from dflash_train.train.checkpoint import (
    CHECKPOINTS,
    TrainState,
    check_provenance,
    checkpoint_dir,
    latest_checkpoint,
    read_provenance,
    restore_trainer,
    save_checkpoint,
)
from dflash_train.train.config import ModelConfig, TrainConfig, resolve_chunk_blocks, to_toml
from dflash_train.train.data import StoreLoader, empty_batch, weights_text
from dflash_train.train.errors import TrainError
from dflash_train.train.noise import noise_std_at
from dflash_train.train.optimizer import build_optimizer
from dflash_train.train.options import option_name
from dflash_train.train.parallel import (
    barrier,
    full_states,
    gather_objects,
    global_norm,
    load_optimizer_state,
    parallel_mode,
    sum_over_ranks,
    wrap,
)
from dflash_train.train.rundir import (
    ResumePoint,
    check_new_run_dir,
    check_resume_config,
    check_same_plan,
    find_resume_point,
    local_paths_absolute,
    run_lock,
    set_aside,
    set_aside_leftovers,
    shape_conflicts,
)
from dflash_train.train.step import block_loss, make_blocks, noised_context

DRAFTER_LAYERS = 5
"""Decoder layers of a drafter when the config leaves them unset (the released drafters')."""
TARGET_CONFIG_FILES = "target"  # store files group holding the target's config.json


SKIPPED_FILE = "skipped.jsonl"
"""Run-directory file listing each damaged sample skipped under loader.skip_corrupt."""

COLLAPSED_STEPS = 5
"""Steps in a row with a positive loss and a gradient norm of exactly 0 that stop a run as
collapsed: no weight receives any signal (a sum of squares over every gradient is exactly 0
only when each is), so no later step can learn; a too-high --lr typically leaves this."""


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


def _distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def parameter_count(n: int) -> str:
    """An honest count: exact below a million, else millions or billions to 3 digits."""
    if n < 10**6:
        return f"{n:,}"
    if n < 10**9:
        return f"{n / 1e6:.3g}M"
    return f"{n / 1e9:.3g}B"


def drafter_config(cfg: TrainConfig, store: Store) -> DrafterConfig:
    """The drafter's shape: width, vocab and layer ids from the store; the rest from cfg."""
    meta = store.meta
    try:
        target = json.loads(store.read_files(TARGET_CONFIG_FILES)["config.json"])
    except (StoreError, KeyError) as e:
        raise TrainError(f"{store.url} holds no target config.json; re-run extract") from e
    mask = cfg.model.mask_token_id
    if mask is None:
        mask = meta.extra.get("mask_token_id")
    if mask is None:
        raise TrainError(f"{store.url} records no mask token id; pass --model.mask_token_id")
    return shape_drafter(target, int(mask), meta.context_layer_ids, cfg.model)


def shape_drafter(target: dict, mask_token_id: int, layer_ids: list[int],
                  m: ModelConfig) -> DrafterConfig:
    """The drafter for a target config.json: `m`'s fields where set, else a published
    target's released drafter attention, else the target's own heads, all layers full.
    Left unset, the released sliding layers stop one short of the drafter's layer count, so
    its last layer stays full (the released 5-layer drafter: 4 sliding + 1 full)."""
    text = target.get("text_config") or target
    layers = m.num_hidden_layers or DRAFTER_LAYERS
    base = published_attention(target) or AttentionShape(
        text["num_attention_heads"], text["num_key_value_heads"],
        text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
        sliding_layers=0, sliding_window=2048)
    base = replace(base, sliding_layers=min(base.sliding_layers, layers - 1))
    shape = replace(base, **{f.name: getattr(m, f.name) for f in fields(AttentionShape)
                             if getattr(m, f.name) is not None})
    if shape.sliding_layers > layers:
        raise TrainError(f"model.sliding_layers {shape.sliding_layers} is more than the "
                         f"drafter's {layers} layers (--layers {layers}); pass --set "
                         f"model.sliding_layers=N with N <= {layers}, or raise --layers")
    overrides = dict(
        num_hidden_layers=layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        layer_types=(["sliding_attention"] * shape.sliding_layers
                     + ["full_attention"] * (layers - shape.sliding_layers)),
        sliding_window=shape.sliding_window if shape.sliding_layers else None,
    )
    if m.intermediate_size is not None:
        overrides["intermediate_size"] = m.intermediate_size
    return DrafterConfig.for_target(target, mask_token_id, target_layer_ids=layer_ids,
                                    **overrides, **m.dflash2_overrides())


def initial_drafter(m: ModelConfig) -> DFlashDrafter:
    """The drafter `model.init_from` names, as `m` asks for it: as saved, or, for kind
    dflash2 from a DFlash drafter, warm-started (drafter.model.dflash2_from)."""
    try:
        model = load_drafter(m.init_from, kinds=DRAFTER_KINDS)
    except DrafterError as e:
        raise TrainError(f"model.init_from {m.init_from}: {e}") from e
    if model.config.kind == m.kind:
        wanted = m.dflash2_overrides()
        differ = [f"model.{k} {v} (the drafter has {getattr(model.config, k)})"
                  for k, v in wanted.items() if getattr(model.config, k) != v]
        if differ:
            raise TrainError(f"model.init_from {m.init_from} fixes the drafter's shape; these "
                             f"settings differ from it: {'; '.join(differ)}")
        return model
    if m.kind == "dflash":
        raise TrainError(f"model.init_from {m.init_from} is a DFlash 2 drafter; pass --set "
                         "model.kind=dflash2 to train it")
    fields = m.dflash2_overrides()
    fields.pop("kind")
    try:
        return dflash2_from(model, **fields)
    except DrafterError as e:
        raise TrainError(f"model.init_from {m.init_from}: warm start: {e}") from e


def _lr_lambda(total: int, warmup: int, min_ratio: float):
    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return scale


def train(cfg: TrainConfig, resume: bool = False, echo=print) -> TrainResult:
    """Run (or resume) training as configured; returns where the final checkpoint is."""
    if not cfg.stores:
        raise TrainError("no store given: pass --store PATH")
    rank = int(os.environ.get("RANK", "0"))
    with run_lock(Path(cfg.run.out_dir), rank):
        return _train(cfg, resume, echo)


def _train(cfg: TrainConfig, resume: bool, echo) -> TrainResult:
    # recorded absolute in config.toml: a resume from another cwd names the same stores
    cfg = replace(cfg, stores=local_paths_absolute(cfg.stores))
    rank, world = _distributed()
    device = resolve_device(cfg.run.device, TrainError, rank)
    if device.type == "cuda":
        # NCCL object collectives (the resume agreement) place buffers on the current device
        torch.cuda.set_device(device)
    elif cfg.run.attention == "flex":
        raise TrainError(f"run.attention flex trains on CUDA only (flex_attention has no "
                         f"backward on {device.type}); use split or dense")
    precision = cfg.run.precision
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    run_dir = Path(cfg.run.out_dir)
    torch.manual_seed(cfg.run.seed)

    # The run directory: a new run never mixes into an old one; a resume continues the run
    # it finds exactly as configured (rundir.RUN_MANAGEMENT_FIELDS aside), from the newest
    # checkpoint that reads whole. Every rank checks before rank 0 writes anything.
    point = _resume_point(run_dir, cfg, rank, world, echo) if resume else None
    if point is None:
        check_new_run_dir(run_dir)
        moved = set_aside_leftovers(run_dir) if rank == 0 else None
        if moved:
            echo(f"note: {run_dir} holds a run that stopped before its first checkpoint; "
                 f"moved its {', '.join(moved[0])} to {moved[1]} and starting a new run")
    barrier(world)

    # Data: a deterministic plan over complete parts; this rank reads only its share. On CUDA
    # batches are padded to few shapes, so compiled flex attention does not recompile often.
    cuda = device.type == "cuda"
    loader_cfg = replace(cfg.loader, pad_to=cfg.loader.pad_to if not cuda or
                         cfg.loader.pad_to > 1 else 256)
    pad_blocks_to = cfg.run.pad_blocks_to or (32 if cuda else 1)
    loader = StoreLoader(cfg.stores, loader_cfg, rank=rank, world=world)
    store = loader.stores[0]
    if rank == 0:
        _announce_unfinished(loader, echo)
    if not loader.has_trainable_block():
        raise TrainError(_nothing_to_train(cfg))
    steps_per_epoch = loader.batches_per_epoch()
    total_steps = steps_per_epoch * cfg.optim.epochs
    if cfg.optim.max_steps is not None:
        total_steps = min(total_steps, cfg.optim.max_steps)
    if total_steps == 0:
        raise TrainError(f"{option_name('loader.store_weights')} "
                         f"{weights_text(cfg.loader.store_weights or [])} draws no sample in "
                         "epoch 0: nothing to train on; raise the weights")
    plan = loader.plan_inputs()
    if point is not None:
        done = TrainState(**point.trainer["state"])
        check_same_plan(done.plan, plan, point.path)
        if _finished(done, loader, cfg, total_steps):
            return TrainResult(done.step, float("nan"), point.path, run_dir,
                               already_complete=True)

    # Drafter: built for the store's target, borrowing its frozen embed_tokens / lm_head. A
    # resume trains the checkpoint's own drafter, as its config.json describes it: defaults
    # that resolve differently today (rundir.config_changes) must not build another one.
    rows = store.target_rows()
    if point is not None:
        check_provenance(point.provenance, store.meta, store.url, str(point.path), same_data=True)
        model = point.drafter
    elif cfg.model.init_from:
        model = initial_drafter(cfg.model)
        conflicts = shape_conflicts(cfg.model, model.config)
        if conflicts:
            raise TrainError(f"model.init_from {cfg.model.init_from} fixes the drafter's shape; "
                             f"these settings differ from it: {'; '.join(conflicts)}")
        init_meta = read_provenance(cfg.model.init_from)
        if init_meta is not None:
            check_provenance(init_meta, store.meta, store.url, cfg.model.init_from)
    else:
        model = DFlashDrafter(drafter_config(cfg, store))
    dcfg = model.config
    if cfg.run.fsdp and dcfg.kind == "dflash2":
        # The selector term reads the selector's weights outside the forward, where FSDP2
        # has not gathered them.
        raise TrainError("run.fsdp does not train a DFlash 2 drafter yet; use DDP (drop "
                         "--fsdp)")
    if rank == 0:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        echo(f"drafter: {dcfg.describe()}; {parameter_count(trainable)} trainable parameters")
    head_dtype = torch.bfloat16 if use_bf16 else torch.float32
    model.attach_target_head(rows["embed_tokens"].to(device, head_dtype),
                             rows["lm_head"].to(device, head_dtype))
    model.to(device)
    model.gradient_checkpointing = cfg.run.gradient_checkpointing
    model.chunk_blocks = resolve_chunk_blocks(cfg.run, device.type == "cuda")
    model.train()
    layer_rms = None
    if cfg.noise.kind != "none" and not cfg.noise.absolute:
        # Over the parts the loader checked and found sound (its check is not repeated); a
        # shard failing its checksum is refused here too, or, when skipping, left out.
        skip = cfg.loader.skip_corrupt
        damaged_parts = {d.part for d in loader.damage if d.store == store.url}
        sound = [p.index for i, p in loader.parts if i == 0 and p.index not in damaged_parts]
        try:
            stats = store_stats(store, skip_damaged=skip, checked_parts=sound,
                                max_tokens=cfg.noise.stats_max_tokens)
        except StoreError as e:  # unreadable context; skipping steps around it, as in reading
            raise StoreError(f"{e}; pass {SKIP_HINT} to skip the damaged samples") from e
        layer_rms = torch.tensor(stats.rms, device=device)

    # Wrap before the optimiser exists: FSDP2 replaces the parameters with sharded ones.
    mode = parallel_mode(world, cfg.run.fsdp)
    forward_model = wrap(model, mode, device)
    optimizer = build_optimizer(model, cfg.optim)
    warmup = max(1, round(cfg.optim.warmup_ratio * total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(total_steps, warmup, cfg.optim.min_lr_ratio))
    state = TrainState(plan=plan)
    if point is not None:
        resumed_from = point.path
        state, optimizer_state = restore_trainer(point.trainer, scheduler)
        state.plan = plan  # checked equal above; recorded again by checkpoints before it was
        try:
            load_optimizer_state(model, optimizer, optimizer_state)
        except (RuntimeError, ValueError, KeyError) as e:
            raise TrainError(f"{resumed_from}: its optimizer state does not fit this drafter "
                             f"({one_line(e)})") from e
        # The optimizer holds its state now: the checkpoint as read (trainer.pt with a second
        # copy of the Adam moments) must not stay alive for the whole run.
        point = optimizer_state = None
        if rank == 0:
            echo(f"resumed from {resumed_from} (step {state.step}, epoch {state.epoch})")

    config_toml = to_toml(cfg)
    if rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.toml").write_text(config_toml)
        except OSError as e:
            raise TrainError(f"--out {run_dir}: cannot write the run directory: {e}") from e
    log = (run_dir / "log.jsonl").open("a") if rank == 0 else None
    board = _tensorboard(run_dir) if rank == 0 and cfg.run.tensorboard else None
    bar = tqdm(total=total_steps, initial=state.step, disable=rank != 0 or not cfg.run.progress,
               desc="train", unit="step", dynamic_ncols=True)
    last_loss = float("nan")
    checkpoint = None
    skipped = _SkipLedger(run_dir / SKIPPED_FILE, rank, echo)
    health = _StepHealth(run_dir, dcfg.vocab_size, cfg.optim.lr)
    for damage in loader.damage:  # found before reading: whole parts never enter the plan
        skipped.record(damage, state.step)

    def save() -> Path | None:
        """Every rank gathers (a collective under FSDP); rank 0 writes."""
        model_state, optimizer_state = full_states(model, optimizer)
        path = None
        if rank == 0:
            path = save_checkpoint(run_dir, model, model_state, optimizer_state, scheduler,
                                   state, store.meta, config_toml, keep=cfg.run.keep_checkpoints)
        barrier(world)
        return path

    while state.epoch < cfg.optim.epochs and state.step < total_steps:
        batches = loader.epoch(state.epoch, skip_batches=state.batch_in_epoch)
        wait_start = time.perf_counter()
        for batch in batches:
            data_wait = time.perf_counter() - wait_start
            step_start = time.perf_counter()
            batch = batch if batch is not None else empty_batch(store)
            for damage in batch.skipped:
                skipped.record(damage, state.step + 1)
            blocks = make_blocks(batch, mask_token_id=dcfg.mask_token_id,
                                 block_size=dcfg.block_size,
                                 anchors_per_seq=cfg.run.anchors_per_seq, seed=cfg.run.seed,
                                 epoch=state.epoch, soft_targets=cfg.loss.kind == "kl-topk",
                                 pad_blocks_to=pad_blocks_to)
            # Labels and which slots count are fixed above from stored verifier ids; only now is
            # the context noised, on a copy that nothing but the drafter's fc reads.
            context = noised_context(batch, layer_rms, cfg.noise, seed=cfg.run.seed,
                                     epoch=state.epoch, step=state.step, device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                hidden = forward_model(context, batch.lengths.to(device),
                                       blocks.block_ids.to(device), blocks.anchors.to(device),
                                       attention=cfg.run.attention)
                # DDP and FSDP average gradients over ranks; each rank's share of the global
                # weighted sum is scaled back up so the result is the single-process gradient.
                loss = block_loss(hidden, blocks, model.target_lm_head, cfg.loss,
                                  global_sum=sum_over_ranks if world > 1 else None,
                                  drafter=model) * world
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf)
            optimizer.step()
            scheduler.step()
            state.step += 1
            state.batch_in_epoch += 1
            state.tokens_seen += int(batch.lengths.sum())
            reported = loss.detach() / world  # this rank's share of the global loss
            if world > 1:
                dist.all_reduce(reported)
            last_loss, norm = reported.item(), global_norm(grad_norm)
            if log is not None:
                record = {
                    "step": state.step, "epoch": state.epoch, "loss": last_loss,
                    "lr": scheduler.get_last_lr()[0], "grad_norm": norm,
                    "tokens": int(batch.lengths.sum()), "samples": len(batch.refs),
                    "skipped": len(batch.skipped),
                    "blocks": int(blocks.valid.any(-1).sum()),
                    "noise_std": noise_std_at(cfg.noise, state.step - 1),
                    "data_wait_s": data_wait, "step_s": time.perf_counter() - step_start,
                }
                record["tokens_per_s"] = record["tokens"] / max(1e-9, data_wait + record["step_s"])
                if state.step % cfg.run.log_every == 0 or state.step == total_steps:
                    record.update(_accuracy(hidden.detach(), blocks, model))
                log.write(json.dumps(record) + "\n")
                log.flush()
                if board is not None:
                    _board_write(board, record)
            health.check(state.step, last_loss, norm)  # global values: every rank agrees
            bar.update(1)
            bar.set_postfix(loss=f"{last_loss:.3f}", epoch=state.epoch)
            if state.step % cfg.run.checkpoint_every == 0:
                checkpoint = save()
            if state.step >= total_steps:
                break
            wait_start = time.perf_counter()
        else:
            state.epoch += 1
            state.batch_in_epoch = 0
            continue
        break
    bar.close()
    if latest_checkpoint(run_dir) != checkpoint_dir(run_dir, state.step):
        checkpoint = save()
    if log is not None:
        log.close()
    if board is not None:
        board.close()
    barrier(world)
    if skipped.count:
        echo(f"skipped {skipped.count} damaged sample(s) or part(s) (--skip-corrupt); "
             f"listed in {run_dir / SKIPPED_FILE}")
    return TrainResult(state.step, last_loss, checkpoint or latest_checkpoint(run_dir), run_dir,
                       skipped.count)


def _finished(done: TrainState, loader: StoreLoader, cfg: TrainConfig, total_steps: int) -> bool:
    """Whether a checkpoint's position is the end of the run (its last epoch's last batch
    may have been saved before the epoch counter moved on)."""
    last = cfg.optim.epochs - 1
    return (done.step >= total_steps or done.epoch > last
            or (done.epoch == last and done.batch_in_epoch >= loader.batches_per_epoch(last)))


def _resume_point(run_dir: Path, cfg: TrainConfig, rank: int, world: int,
                  echo) -> ResumePoint:
    """The checkpoint a resume continues from, the same on every rank, its config checked
    against cfg; damaged newer ones are named and (rank 0, once every rank has chosen)
    renamed out of rotation."""
    try:
        point, failure = find_resume_point(run_dir), None
    except Exception as e:  # told to the other ranks first, so that none waits forever
        point, failure = None, e
    choice = point.path.name if point is not None else f"none ({type(failure).__name__})"
    check_same_choice(gather_objects(choice, world), run_dir)
    if failure is not None:
        raise failure
    check_resume_config(point, cfg)
    barrier(world)
    for path, reason in point.damaged:
        aside = set_aside(path) if rank == 0 else path
        if rank == 0:
            echo(f"note: {reason}; resuming from the previous complete checkpoint "
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


def _announce_unfinished(loader: StoreLoader, echo) -> None:
    """One line naming the parts left out because extraction has not finished them."""
    named = [f"{s.url} part(s) {', '.join(map(str, parts))}" for s in loader.stores
             if (parts := s.unfinished_parts())]
    if named:
        echo(f"leaving out unfinished parts (extraction still running or stopped; training "
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


class _StepHealth:
    """Stops a run whose step went non-finite or whose gradient died, before the step can
    reach a checkpoint: the latest one stays the last finite (and live) weights."""

    def __init__(self, run_dir: Path, vocab_size: int, lr: float):
        self.run_dir, self.vocab_size, self.lr = run_dir, vocab_size, lr
        self.zero_since: int | None = None

    def check(self, step: int, loss: float, grad_norm: float) -> None:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            kept = latest_checkpoint(self.run_dir)
            kept = f"the latest checkpoint, {kept}," if kept else "no checkpoint was written; it"
            raise TrainError(
                f"step {step}: non-finite loss {loss} / gradient norm {grad_norm}: training "
                f"diverged and is stopped before this step is saved; {kept} holds the last "
                "finite weights. Lower --lr or --noise-std, or check the store with `dflash "
                "store validate`, then start a new run with another --out")
        if grad_norm != 0 or not loss > 0:
            self.zero_since = None
            return
        self.zero_since = self.zero_since or step
        if step - self.zero_since + 1 >= COLLAPSED_STEPS:
            raise TrainError(
                f"steps {self.zero_since}-{step}: the gradient norm is exactly 0 at a loss of "
                f"{loss:.4f} (ln V = {math.log(self.vocab_size):.4f}: uniform predictions): "
                f"the drafter collapsed and no further step can train it (a too-high --lr "
                f"does this; this run's: {self.lr:g}); start a new run with a lower --lr or "
                "other initial weights, in another --out")


class _SkipLedger:
    """Damaged samples skipped by this rank: each is announced and listed once (a sample
    skipped again in a later epoch is not repeated)."""

    def __init__(self, path: Path, rank: int, echo):
        self.path, self.rank, self.echo = path, rank, echo
        self.seen: set[tuple] = set()

    @property
    def count(self) -> int:
        return len(self.seen)

    def record(self, damage, step: int) -> None:
        key = (damage.store, damage.part, damage.sample)
        if key in self.seen:
            return
        self.seen.add(key)
        self.echo(f"skipping damaged data (--skip-corrupt): {damage}")
        line = json.dumps({"step": step, "rank": self.rank, **damage.as_dict()}) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:  # one small append per line: ranks may share the file
            f.write(line)


def _tensorboard(run_dir: Path):
    try:
        from tensorboardX import SummaryWriter
    except ImportError as e:
        raise TrainError("run.tensorboard needs tensorboardX: "
                         "pip install 'dflash-train[tb]'") from e
    return SummaryWriter(str(run_dir / "tb"))


def _board_write(board, record: dict) -> None:
    """The log record's numbers as scalars; per-slot accuracy as one scalar per slot."""
    step = record["step"]
    for key, value in record.items():
        if key in ("step", "epoch"):
            continue
        if key == "slot_acc":
            for slot, acc in enumerate(value, 1):
                if acc is not None:
                    board.add_scalar(f"slot_acc/{slot:02d}", acc, step)
        elif isinstance(value, (int, float)) and value is not None:
            board.add_scalar(key, value, step)


@torch.no_grad()
def _accuracy(hidden: torch.Tensor, blocks, model: DFlashDrafter) -> dict:
    """Per-slot accuracy of the drafts and the training tau estimate on this batch's blocks:
    each slot's argmax, or a DFlash 2 drafter's selector walk, whose selector_recall is the
    fraction of labelled slots whose label is among the slot's top-K candidates."""
    hidden = hidden.flatten(0, 1).float()
    labels, valid = blocks.labels.flatten(0, 1), blocks.valid.flatten(0, 1)
    out = {}
    if model.candidate_selector is None:
        _, ids = draft_topk(hidden, model.target_lm_head.float(), k=1)
        ids = ids.cpu()
    else:
        anchors = blocks.block_ids[:, :, 0].flatten().to(hidden.device)
        walk = model.propose(hidden[:, 1:].to(model.fc.weight.dtype), anchors).cpu()
        ids = torch.cat([torch.full_like(walk[:, :1], -1), walk], dim=1)
        _, top = draft_topk(hidden, model.target_lm_head.float(),
                            k=model.candidate_selector.top_k)
        hit = (top.cpu() == labels[..., None]).any(-1) & valid
        hit[:, 0] = False
        counted = valid.clone()
        counted[:, 0] = False
        out["selector_recall"] = float(hit.sum()) / max(1, int(counted.sum()))
    stats = AcceptanceStats(block_size=hidden.shape[1], recall_at=(1,))
    stats.update(ids, labels, valid)
    s = stats.summary()
    return {"slot_acc": s["slot_accuracy"], "train_tau": s["mean_tau"], **out}
