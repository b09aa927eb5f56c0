"""The training loop end to end on a synthetic store whose verifier follows a learnable rule."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_train.blocks import draft_topk
from dflash_train.cli import main
from dflash_train.drafter import DrafterConfig, load_drafter
from dflash_train.drafter.config import DRAFTER_KINDS
from dflash_train.evaluate.metrics import AcceptanceStats
from dflash_train.store_schema import StoreError, open_store
from dflash_train.train.checkpoint import latest_checkpoint
from dflash_train.train.config import ModelConfig, load_train_config
from dflash_train.train.data import StoreLoader
from dflash_train.train.drafter_shape import shape_drafter
from dflash_train.train.errors import TrainError
from dflash_train.train.loader_config import LoaderConfig
from dflash_train.train.loop import train
from dflash_train.train.noise import NoiseConfig
from dflash_train.train.step import make_blocks, noised_context
from tests.train.conftest import MASK, build_store

REPO = Path(__file__).resolve().parents[2]


FP32 = {"run.precision": "fp32"}
"""For tests comparing two computations to float32 rounding: under run.precision=auto a CPU
with native bf16 trains in bf16, which rounds each path differently."""


def _cfg(store, out, **extra):
    overrides = {"stores": [store], "run.out_dir": str(out), "model.num_hidden_layers": 1,
                 "loader.batch_tokens": 256, "run.anchors_per_seq": 8, "optim.lr": 3e-3,
                 "run.progress": False, "run.log_every": 1, "loader.prefetch_batches": 0}
    overrides.update(extra)
    return load_train_config(None, overrides)


@torch.no_grad()
def held_out_tau(checkpoint, store_url) -> float:
    """Mean acceptance length over every eligible anchor of a held-out store."""
    model = load_drafter(checkpoint)
    rows = open_store(store_url).target_rows()
    model.attach_target_head(rows["embed_tokens"], rows["lm_head"])
    stats = AcceptanceStats(block_size=model.config.block_size, recall_at=(1,))
    loader = StoreLoader([store_url], LoaderConfig(batch_tokens=512, prefetch_batches=0))
    for batch in loader.epoch(0):
        blocks = make_blocks(batch, mask_token_id=MASK, block_size=16, anchors_per_seq=10**6,
                             seed=0, epoch=0)
        hidden = model(batch.context, batch.lengths, blocks.block_ids, blocks.anchors)
        _, ids = draft_topk(hidden.flatten(0, 1), model.target_lm_head, k=1)
        stats.update(ids, blocks.labels.flatten(0, 1), blocks.valid.flatten(0, 1))
    return stats.summary()["mean_tau"]


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("held_out") / "hs.zarr")
    build_store(url, rows=8, parts=1, seed=0)  # same target (code table), other rows
    return url


def test_loss_falls_and_held_out_tau_rises(synthetic_store, held_out, tmp_path):
    untrained = train(_cfg(synthetic_store, tmp_path / "r0", **{"optim.max_steps": 1,
                                                              "optim.lr": 1e-12}))
    result = train(_cfg(synthetic_store, tmp_path / "r1", **{"optim.epochs": 40}))
    log = [json.loads(line) for line in (tmp_path / "r1" / "log.jsonl").open()]
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    tau0 = held_out_tau(untrained.checkpoint, held_out)
    tau1 = held_out_tau(result.checkpoint, held_out)
    assert tau1 > tau0 + 2.0, (tau0, tau1)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_noise_never_reaches_labels_only_the_fc_input(synthetic_store, tmp_path, kind):
    extra = {"model.selector_rank": 8, "model.selector_top_k": 4} if kind == "dflash2" else {}
    result = train(_cfg(synthetic_store, tmp_path / "r", **{"optim.max_steps": 1,
                                                             "model.kind": kind, **extra}))
    model = load_drafter(result.checkpoint, kinds=DRAFTER_KINDS)
    assert model.config.kind == kind
    rows = open_store(synthetic_store).target_rows()
    model.attach_target_head(rows["embed_tokens"], rows["lm_head"])
    batch = next(StoreLoader([synthetic_store], LoaderConfig(prefetch_batches=0)).epoch(0))
    clean_context = batch.context.clone()

    seen = {}
    model.fc.register_forward_pre_hook(lambda m, args: seen.__setitem__("fc", args[0].clone()))
    embeds = []
    original_embed = model._embed
    model._embed = lambda ids: embeds.append(ids.clone()) or original_embed(ids)

    reference = make_blocks(batch, mask_token_id=MASK, block_size=16, anchors_per_seq=8,
                            seed=3, epoch=0)
    for seed, std in [(0, 0.0), (1, 0.05), (2, 1.0), (3, 10.0)]:
        blocks = make_blocks(batch, mask_token_id=MASK, block_size=16, anchors_per_seq=8,
                             seed=3, epoch=0)
        noised = noised_context(batch, torch.ones(2), NoiseConfig(std=std), seed=seed, epoch=0,
                                step=0, device=torch.device("cpu"))
        model(noised, batch.lengths, blocks.block_ids, blocks.anchors)
        assert torch.equal(blocks.labels, reference.labels)
        assert torch.equal(blocks.valid, reference.valid)
        assert torch.equal(batch.context, clean_context)  # the batch itself is never noised
        assert torch.equal(embeds[-1], reference.block_ids)  # block tokens are clean
        fc_in = seen["fc"].view_as(batch.context)
        assert torch.equal(fc_in, noised) and (std == 0) == torch.equal(fc_in, clean_context)


def test_checkpoint_refuses_a_store_of_another_target(synthetic_store, tmp_path):
    first = train(_cfg(synthetic_store, tmp_path / "r", **{"optim.max_steps": 2}))
    other = str(tmp_path / "other.zarr")
    build_store(other, rows=8, parts=1, name="another-target")
    cfg = _cfg(other, tmp_path / "r2", **{"model.init_from": str(first.checkpoint)})
    with pytest.raises(TrainError) as e:
        train(cfg)
    assert "target.name_or_path: 'tiny' != 'another-target'" in str(e.value)
    cli = CliRunner().invoke(main, ["train", "--store", other, "--out", str(tmp_path / "r"),
                                    "--resume", "--no-progress"])
    # refused: a store is known by its provenance, not its path (with the run's settings:
    # tests/reliability/test_train_settings.py), and these settings are not the run's either
    assert cli.exit_code == 1 and "stores:" not in cli.output
    assert "Traceback" not in cli.output


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    return load_drafter(latest_checkpoint(run_dir), kinds=DRAFTER_KINDS).state_dict()


DFLASH2_SETS = ["--set", "model.kind=dflash2", "--set", "model.selector_rank=8",
                "--set", "model.selector_top_k=4"]
"""A DFlash 2 drafter small enough for the synthetic store (width 32: conv groups of 16)."""


# Muon's momentum and D-PACE's confidence-driven weights must resume bit-exact as well, and
# a DFlash 2 drafter's factorised selector (its factors, not the E W it also saves).
@pytest.mark.parametrize("variant", [[], ["--set", "optim.optimizer=muon",
                                          "--set", "loss.position_weights=dpace"],
                                     [*DFLASH2_SETS, "--set",
                                      "model.selector_codebooks=factorised"],
                                     ["--set", "model.draft_vocab_size=24"]],
                         ids=["adamw", "muon-dpace", "dflash2-factorised", "draft-vocab"])
def test_killed_run_resumes_to_the_same_weights(synthetic_store, tmp_path, variant):
    args = ["--store", synthetic_store, "--layers", "1", "--batch-tokens", "256",
            "--anchors-per-seq", "8", "--epochs", "3", "--no-progress",
            "--set", "run.checkpoint_every=4", "--set", "loader.prefetch_batches=0", *variant]
    whole = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "whole"), *args])
    assert whole.exit_code == 0, whole.output

    run = tmp_path / "killed"
    # bit-exact holds at one intra-op thread count (float sums split by thread differ): the
    # killed process gets this process's, whatever earlier tests in this process left it at
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen([sys.executable, "-m", "dflash_train", "train", "--out", str(run),
                             *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while latest_checkpoint(run) is None or latest_checkpoint(run).name < "step_00000008":
        assert proc.poll() is None and time.time() < deadline, "run ended before the kill"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = CliRunner().invoke(main, ["train", "--out", str(run), "--resume", *args])
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from" in resumed.output
    a, b = _final_weights(tmp_path / "whole"), _final_weights(run)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_unknown_setting_is_an_error_naming_it(synthetic_store, tmp_path):
    result = CliRunner().invoke(main, ["train", "--store", synthetic_store, "--set",
                                       "optim.learning_rate=1"])
    assert result.exit_code == 1 and "unknown key(s) ['learning_rate']" in result.output


def test_gamma_defaults_to_10():
    assert load_train_config(None, {}).loss.gamma == 10.0


def test_export_writes_the_serving_directory(synthetic_store, tmp_path):
    result = train(_cfg(synthetic_store, tmp_path / "r", **{"optim.max_steps": 1}))
    out = tmp_path / "served"
    cli = CliRunner().invoke(main, ["export", str(result.checkpoint), str(out)])
    assert cli.exit_code == 0, cli.output
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [1, 2]
    exported = load_drafter(out).state_dict()
    trained = load_drafter(result.checkpoint).state_dict()
    assert exported.keys() == trained.keys()
    assert all(exported[k].dtype == torch.bfloat16 for k in exported)
    again = CliRunner().invoke(main, ["export", str(result.checkpoint), str(out)])
    assert again.exit_code == 1 and "Traceback" not in again.output


def tensorboard_tags(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar a run wrote to TensorBoard: tag -> [(step, value)]."""
    from tensorboardX.proto import event_pb2

    (events,) = (run_dir / "tb").glob("events.out.tfevents.*")
    tags = {}
    data = events.read_bytes()
    pos = 0
    while pos < len(data):  # TFRecord framing: length, crc, payload, crc
        length = int.from_bytes(data[pos:pos + 8], "little")
        event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
        pos += 16 + length
        for v in event.summary.value:
            tags.setdefault(v.tag, []).append((event.step, v.simple_value))
    return tags


def test_tensorboard_events_carry_the_logged_scalars(synthetic_store, tmp_path):
    train(_cfg(synthetic_store, tmp_path / "r", **{"optim.max_steps": 3,
                                                  "run.tensorboard": True}))
    tags = tensorboard_tags(tmp_path / "r")
    log = [json.loads(line) for line in (tmp_path / "r" / "log.jsonl").open()]
    assert [s for s, _ in tags["loss"]] == [1, 2, 3]
    assert [v for _, v in tags["loss"]] == pytest.approx([r["loss"] for r in log])
    assert "slot_acc/01" in tags and "lr" in tags


def test_padding_batches_and_blocks_leaves_the_loss_unchanged(synthetic_store, tmp_path):
    plain = train(_cfg(synthetic_store, tmp_path / "a", **FP32, **{"optim.max_steps": 3}))
    padded = train(_cfg(synthetic_store, tmp_path / "b", **FP32, **{
        "optim.max_steps": 3, "loader.pad_to": 64, "run.pad_blocks_to": 16}))
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "log.jsonl").open()]
              for run in ("a", "b")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    _assert_same_weights(plain.checkpoint, padded.checkpoint)


def _assert_same_weights(a_checkpoint, b_checkpoint) -> None:
    """Two runs' drafters agree up to float rounding, tensor by tensor. Adam divides each
    gradient by its own RMS, so an entry whose gradients are near 0 turns reordered sums into
    up to ~2e-6 of weight after 3 steps; a real difference moves a weight by ~lr (3e-3)."""
    a, b = load_drafter(a_checkpoint).state_dict(), load_drafter(b_checkpoint).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_chunked_blocks_train_what_one_pass_trains(synthetic_store, tmp_path):
    # 4 blocks a chunk: every batch (~5 sequences x 8 anchors) runs in many chunks, each
    # recomputed in backward; the losses and weights are those of one pass over all blocks.
    whole = train(_cfg(synthetic_store, tmp_path / "a", **FP32, **{"optim.max_steps": 3,
                                                                     "run.chunk_blocks": 0}))
    chunked = train(_cfg(synthetic_store, tmp_path / "b", **FP32, **{"optim.max_steps": 3,
                                                                       "run.chunk_blocks": 4}))
    logs = [[json.loads(line) for line in (tmp_path / run / "log.jsonl").open()]
            for run in ("a", "b")]
    assert min(r["blocks"] for r in logs[1]) > 4
    assert [r["loss"] for r in logs[0]] == pytest.approx([r["loss"] for r in logs[1]],
                                                          rel=1e-5)
    _assert_same_weights(whole.checkpoint, chunked.checkpoint)


def test_dense_attention_trains_what_split_attention_trains(synthetic_store, tmp_path,
                                                            monkeypatch):
    # run.attention reaches the drafter: the dense reference path and the split path (the
    # CPU default) give the same losses and weights, and flex is refused off CUDA up front.
    import dflash_train.drafter.model as drafter_model

    built = []
    for name, build in list(drafter_model._ATTENDS.items()):
        monkeypatch.setitem(drafter_model._ATTENDS, name,
                            lambda *a, name=name, build=build: built.append(name) or build(*a))
    runs = {}
    for name in ("dense", "split"):
        runs[name] = train(_cfg(synthetic_store, tmp_path / name, **FP32, **{
            "optim.max_steps": 3, "run.attention": name}))
        assert set(built) == {name}
        built.clear()
    logs = {name: [json.loads(line)["loss"] for line in (tmp_path / name / "log.jsonl").open()]
            for name in runs}
    assert logs["dense"] == pytest.approx(logs["split"], rel=1e-5)
    _assert_same_weights(runs["dense"].checkpoint, runs["split"].checkpoint)
    with pytest.raises(TrainError, match="flex trains on CUDA only"):
        train(_cfg(synthetic_store, tmp_path / "flex", **{"run.attention": "flex"}))
    assert not (tmp_path / "flex").exists()


QWEN3_6_27B_TARGET = {  # the config.json Qwen3.6-27B ships (multimodal wrapper)
    "model_type": "qwen3_5",
    "text_config": dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        intermediate_size=17408, vocab_size=248320, rms_norm_eps=1e-6,
                        max_position_embeddings=262144,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e7}),
}


def test_a_27b_store_gets_the_released_drafter_shape_by_default():
    cfg = shape_drafter(QWEN3_6_27B_TARGET, 248070, [1, 16, 31, 46, 61], ModelConfig())
    # docs/reference.md §1, not the target's 24 x 256 heads
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert cfg.layer_types == ["sliding_attention"] * 4 + ["full_attention"]
    assert cfg.sliding_window == 2048 and cfg.intermediate_size == 17408
    assert cfg.rope_theta == 1e7
    assert cfg == DrafterConfig.qwen3_6_27b()


def test_explicit_model_fields_override_the_released_shape():
    m = ModelConfig(num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                    sliding_layers=0)
    cfg = shape_drafter(QWEN3_6_27B_TARGET, 248070, [1, 16, 31, 46, 61], m)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (24, 4, 256)
    assert cfg.layer_types == ["full_attention"] * 5 and cfg.sliding_window is None


def test_another_target_lends_its_own_heads_and_all_layers_are_full():
    target = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=400)
    cfg = shape_drafter(target, 5, [0, 1], ModelConfig(num_hidden_layers=3, sliding_layers=1,
                                                       sliding_window=8))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.layer_types == ["sliding_attention", "full_attention", "full_attention"]
    assert cfg.sliding_window == 8
    assert shape_drafter(target, 5, [0, 1], ModelConfig()).layer_types == ["full_attention"] * 5


def test_more_sliding_layers_than_layers_is_refused_naming_the_fix():
    with pytest.raises(TrainError) as e:
        shape_drafter(QWEN3_6_27B_TARGET, 248070, [1], ModelConfig(sliding_layers=6))
    message = str(e.value)
    assert "model.sliding_layers 6 is more than the drafter's 5 layers (--layers 5)" in message
    assert "--set model.sliding_layers=N with N <= 5" in message


S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize(("layers", "expected"), [
    (1, [F]), (2, [S, F]), (3, [S, S, F]), (4, [S, S, S, F]), (5, [S, S, S, S, F]),
    (7, [S, S, S, S, F, F, F]),
])
def test_a_27b_drafter_of_any_depth_keeps_its_last_layer_full(layers, expected):
    cfg = shape_drafter(QWEN3_6_27B_TARGET, 248070, [1, 16, 31, 46, 61],
                        ModelConfig(num_hidden_layers=layers))
    assert cfg.layer_types == expected
    assert cfg.sliding_window == (2048 if S in expected else None)
    # an explicit count is taken as given, all sliding included
    explicit = shape_drafter(QWEN3_6_27B_TARGET, 248070, [1, 16, 31, 46, 61],
                             ModelConfig(num_hidden_layers=layers, sliding_layers=layers))
    assert explicit.layer_types == [S] * layers


def test_nothing_to_train_on_is_refused_up_front_naming_the_option(synthetic_store, tmp_path):
    # every synthetic sample's first 4 tokens are prompt: no block fits in 4 tokens
    for extra, option in ([["--weights", "0"], "--weights"],
                          [["--max-length", "4"], "--max-length"]):
        out = tmp_path / option.strip("-")
        result = CliRunner().invoke(main, ["train", "--store", synthetic_store, "--out",
                                           str(out), "--layers", "1", "--no-progress", *extra])
        assert result.exit_code == 1, result.output
        assert f"Error: {option} (" in result.output and "Traceback" not in result.output
        assert not out.exists()
    # one more token holds a block (anchor 4, label 5): training goes ahead
    ok = train(_cfg(synthetic_store, tmp_path / "ok", **{"loader.max_length": 6,
                                                         "optim.max_steps": 1}))
    assert ok.steps == 1


def test_mixed_stores_refusal_reads_as_the_first_store_against_the_second(synthetic_store,
                                                                           tmp_path):
    other = str(tmp_path / "other.zarr")
    build_store(other, rows=8, parts=1, name="another-target")
    with pytest.raises(StoreError) as e:
        StoreLoader([synthetic_store, other], LoaderConfig(prefetch_batches=0))
    message = str(e.value)
    assert message.startswith(f"{other} does not match {synthetic_store}")
    assert "target.name_or_path: 'another-target' != 'tiny'" in message
    assert "[" not in message.split(":", 1)[1].split("\n")[0]  # no list repr


def _flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2
    data[i:i + 8] = bytes(b ^ 0x5A for b in data[i:i + 8])
    path.write_bytes(bytes(data))


def test_a_context_checksum_refusal_offers_skip_corrupt(synthetic_store, tmp_path):
    import shutil

    store = Path(shutil.copytree(synthetic_store, tmp_path / "hs.zarr"))
    shard = sorted((store / "parts" / "00000" / "context" / "c").rglob("*"))
    _flip_middle(next(p for p in shard if p.is_file()))
    result = CliRunner().invoke(main, ["train", "--store", str(store), "--out",
                                       str(tmp_path / "r"), "--layers", "1", "--no-progress",
                                       "--max-steps", "1"])
    assert result.exit_code == 1
    assert "checksum" in result.output and "pass --skip-corrupt" in result.output


def test_a_tiny_drafter_reports_its_exact_parameter_count(synthetic_store, tmp_path):
    lines = []
    result = train(_cfg(synthetic_store, tmp_path / "r", **{"optim.max_steps": 1}),
                   echo=lines.append)
    n = sum(p.numel() for p in load_drafter(result.checkpoint).parameters())
    assert n < 10**6
    assert any(line.endswith(f"; {n:,} trainable parameters") for line in lines), lines


def test_parameter_counts_keep_their_digits():
    from dflash_train.train.run import parameter_count

    assert parameter_count(12_345) == "12,345"
    assert parameter_count(1_234_567) == "1.23M"
    assert parameter_count(1_700_000_000) == "1.7B"


def test_unfinished_parts_are_named_in_one_line_and_left_out(tmp_path):
    url = str(tmp_path / "partial.zarr")
    build_store(url, rows=24, parts=3, unfinished=1)
    lines = []
    result = train(_cfg(url, tmp_path / "r", **{"optim.max_steps": 1}), echo=lines.append)
    named = [line for line in lines if "unfinished" in line]
    assert len(named) == 1 and f"{url} part(s) 2" in named[0], lines
    assert result.steps == 1


def test_a_device_torch_cannot_use_is_a_train_error(synthetic_store, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TrainError, match="--device 'cuda'.*no CUDA device"):
        train(_cfg(synthetic_store, tmp_path / "r", **{"run.device": "cuda"}))
    assert not (tmp_path / "r").exists()


def test_help_shows_a_default_for_every_setting_option():
    import re

    text = CliRunner().invoke(main, ["train", "--help"], terminal_width=200).output
    for option in ("--weights", "--max-length", "--lr", "--epochs"):
        block = re.search(rf"^\s+{option} .*?(?=^\s+--)", text, re.S | re.M).group(0)
        assert "[default: " in block, block


def test_the_structural_check_runs_once_per_start(synthetic_store, tmp_path, monkeypatch):
    # it lists every object of the store: on object storage, the costly part of a start
    import dflash_train.store_schema.integrity as integrity

    calls = []
    real = integrity.validate

    def counting(store, **kw):
        calls.append(store.url)
        return real(store, **kw)

    monkeypatch.setattr(integrity, "validate", counting)
    cfg = _cfg(synthetic_store, tmp_path / "r", **{"optim.max_steps": 1})
    assert cfg.noise.kind != "none" and not cfg.noise.absolute  # the statistics are needed
    train(cfg)
    assert calls == [synthetic_store]


def test_a_store_whose_loss_masks_are_all_damaged_is_refused_as_damaged(synthetic_store,
                                                                        tmp_path):
    import shutil

    store = Path(shutil.copytree(synthetic_store, tmp_path / "hs.zarr"))
    chunks = [p for p in (store / "parts").glob("*/loss_mask/c/**/*") if p.is_file()]
    assert chunks
    for chunk in chunks:
        _flip_middle(chunk)
    with pytest.raises(StoreError) as e:
        StoreLoader([str(store)], LoaderConfig(prefetch_batches=0)).has_trainable_block()
    assert "checksum" in str(e.value) and "pass --skip-corrupt" in str(e.value)
    assert "sample" in str(e.value)  # named down to the sample
    # skipping it leaves nothing to train on, which is then the truth
    skipping = StoreLoader([str(store)], LoaderConfig(prefetch_batches=0, skip_corrupt=True))
    assert skipping.has_trainable_block() is False


def test_weights_drawing_no_sample_are_named_as_typed(synthetic_store, tmp_path):
    with pytest.raises(TrainError) as e:
        train(_cfg(synthetic_store, tmp_path / "r", **{"loader.store_weights": "0.001"}))
    assert "--weights (loader.store_weights) 0.001 draws no sample" in str(e.value)


def test_max_steps_ends_the_learning_rate_schedule_at_its_last_step(synthetic_store, tmp_path):
    ratio = 0.25
    train(_cfg(synthetic_store, tmp_path / "r", **{"optim.max_steps": 4, "optim.epochs": 50,
                                                    "optim.min_lr_ratio": ratio}))
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "r" / "log.jsonl").open()]
    assert len(lrs) == 4
    assert lrs[-1] == pytest.approx(3e-3 * ratio)  # decayed fully within max_steps


# -- DFlash 2 ---------------------------------------------------------------------------


def test_dflash2_trains_from_the_command_line_and_a_config_file(synthetic_store, tmp_path):
    help_text = CliRunner().invoke(main, ["train", "--help"]).output
    assert "model.kind=dflash2" in help_text
    common = ["--store", synthetic_store, "--layers", "1", "--batch-tokens", "256",
              "--anchors-per-seq", "8", "--max-steps", "12", "--no-progress",
              "--set", "loader.prefetch_batches=0", "--set", "run.log_every=1",
              "--set", "optim.lr=3e-3"]
    cli = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "cli"), *common,
                                    *DFLASH2_SETS, "--set", "loss.selector_weight=2"])
    assert cli.exit_code == 0, cli.output
    assert "DFlash 2: convs of 2 taps in groups of 16, selector rank 8 over the top 4" in \
        cli.output
    toml = tmp_path / "dflash2.toml"
    toml.write_text('[model]\nkind = "dflash2"\nselector_rank = 8\nselector_top_k = 4\n'
                    '[loss]\nselector_weight = 2.0\n')
    from_file = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "file"), *common,
                                          "--config", str(toml)])
    assert from_file.exit_code == 0, from_file.output
    a, b = _final_weights(tmp_path / "cli"), _final_weights(tmp_path / "file")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    config = json.loads((latest_checkpoint(tmp_path / "cli") / "drafter" / "config.json")
                        .read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    log = [json.loads(line) for line in (tmp_path / "cli" / "log.jsonl").open()]
    assert all(0 <= r["selector_recall"] <= 1 for r in log)
    assert log[-1]["loss"] < log[0]["loss"]
    # the selector learnt something: its successor codebook left its zero init
    assert a["candidate_selector.successor_codebook"].abs().sum() > 0


def test_a_selector_weight_of_zero_trains_no_selector(synthetic_store, tmp_path):
    result = train(_cfg(synthetic_store, tmp_path / "r", **{
        "optim.max_steps": 3, "model.kind": "dflash2", "model.selector_rank": 8,
        "model.selector_top_k": 4, "loss.selector_weight": 0.0}))
    model = load_drafter(result.checkpoint, kinds=DRAFTER_KINDS)
    assert torch.all(model.candidate_selector.successor_codebook == 0)


def test_dflash2_with_the_kl_loss_is_refused_before_the_run_dir_exists(synthetic_store,
                                                                       tmp_path):
    out = tmp_path / "kl"
    result = CliRunner().invoke(main, ["train", "--store", synthetic_store, "--out", str(out),
                                       "--set", "model.kind=dflash2", "--set",
                                       "loss.kind=kl-topk", "--no-progress"])
    assert result.exit_code != 0 and "kl-topk does not train a DFlash 2" in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_dflash2_settings_are_checked_against_the_kind(synthetic_store, tmp_path):
    with pytest.raises(TrainError, match="model.selector_rank must be left unset unless"):
        load_train_config(None, {"model.selector_rank": 8})
    with pytest.raises(TrainError, match="model.selector_codebooks must be free unless"):
        load_train_config(None, {"model.selector_codebooks": "factorised"})
    with pytest.raises(TrainError, match="run.fsdp does not train a DFlash 2 drafter"):
        train(_cfg(synthetic_store, tmp_path / "f", **{
            "model.kind": "dflash2", "model.selector_rank": 8, "model.selector_top_k": 4,
            "run.fsdp": True}))
