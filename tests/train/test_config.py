"""The train config: every field range-checked with its option named; TOML round-trips."""

import tomllib

import pytest

from dflash_train.train.config import (
    DEFAULT_CHUNK_BLOCKS,
    load_train_config,
    resolve_chunk_blocks,
    to_toml,
    train_config_from_dict,
)
from dflash_train.train.errors import TrainError


@pytest.mark.parametrize(("key", "value", "named"), [
    ("optim.lr", "-1", "--lr (optim.lr)"),
    ("optim.lr", "0", "--lr (optim.lr)"),
    ("optim.lr", "nan", "--lr (optim.lr)"),
    ("optim.betas", "0.9,1.0", "optim.betas"),
    ("optim.betas", "0.9,0.95,0.99", "optim.betas"),
    ("optim.betas", "-0.1,0.9", "optim.betas"),
    ("optim.warmup_ratio", "1.5", "optim.warmup_ratio"),
    ("optim.min_lr_ratio", "-0.1", "optim.min_lr_ratio"),
    ("optim.weight_decay", "-1", "optim.weight_decay"),
    ("optim.epochs", "0", "--epochs (optim.epochs)"),
    ("optim.max_steps", "0", "--max-steps (optim.max_steps)"),
    ("optim.grad_clip", "-1", "optim.grad_clip"),
    ("run.checkpoint_every", "0", "run.checkpoint_every"),
    ("run.keep_checkpoints", "-1", "run.keep_checkpoints"),
    ("run.log_every", "0", "run.log_every"),
    ("run.seed", "-1", "--seed (run.seed)"),
    ("run.anchors_per_seq", "0", "--anchors-per-seq (run.anchors_per_seq)"),
    ("loader.batch_tokens", "0", "--batch-tokens (loader.batch_tokens)"),
    ("loader.max_length", "2", "--max-length (loader.max_length)"),
    ("loader.workers", "-1", "loader.workers"),
    ("loader.store_weights", "1,-1", "--weights (loader.store_weights)"),
    ("loader.store_weights", "0,0", "--weights (loader.store_weights)"),
    ("model.num_hidden_layers", "0", "--layers (model.num_hidden_layers)"),
    ("model.head_dim", "0", "model.head_dim"),
    ("run.chunk_blocks", "-1", "run.chunk_blocks"),
])
def test_out_of_range_settings_are_refused_naming_the_field(key, value, named):
    with pytest.raises(TrainError) as e:
        load_train_config(None, {key: value})
    assert str(e.value).startswith(f"{named} must be "), str(e.value)


@pytest.mark.parametrize(("key", "value"), [
    ("optim.warmup_ratio", "1"), ("optim.warmup_ratio", "0"), ("optim.grad_clip", "0"),
    ("optim.betas", "0,0.999"), ("loader.store_weights", "0,1"), ("loader.max_length", "3"),
    ("run.keep_checkpoints", "0"), ("optim.min_lr_ratio", "1"), ("run.chunk_blocks", "0"),
])
def test_boundary_values_are_accepted(key, value):
    load_train_config(None, {key: value})


def test_an_unknown_section_names_the_top_level():
    with pytest.raises(TrainError) as e:
        load_train_config(None, {"optimz.lr": "1"})
    message = str(e.value)
    assert "['optimz']" in message and "top level" in message
    assert not message.startswith(":")


def test_a_type_error_names_the_cli_option():
    with pytest.raises(TrainError, match=r"^--weights \(loader.store_weights\): 'a'"):
        load_train_config(None, {"loader.store_weights": "a"})


def test_saved_toml_reads_back_to_the_same_config_even_a_non_default_none():
    cfg = load_train_config(None, {"stores": ["a.zarr"], "noise.stats_max_tokens": "none",
                                   "loader.store_weights": "1,0.5", "optim.lr": "3e-3",
                                   "model.head_dim": "8"})
    assert cfg.noise.stats_max_tokens is None  # its default is not None
    assert train_config_from_dict(tomllib.loads(to_toml(cfg))) == cfg


def test_chunk_blocks_defaults_to_chunks_off_cuda_only():
    def resolved(value, cuda):
        return resolve_chunk_blocks(load_train_config(None, {"run.chunk_blocks": value}).run, cuda)

    assert resolved("none", cuda=False) == DEFAULT_CHUNK_BLOCKS
    assert resolved("none", cuda=True) is None  # compiled flex would recompile per chunk
    assert resolved("0", cuda=False) is None and resolved("0", cuda=True) is None
    assert resolved("64", cuda=False) == resolved("64", cuda=True) == 64


def test_chunks_under_fsdp_are_refused_and_fsdp_runs_unchunked():
    with pytest.raises(TrainError, match=r"^run.chunk_blocks must be 0 or unset with --fsdp"):
        load_train_config(None, {"run.fsdp": "true", "run.chunk_blocks": "64"})
    run = load_train_config(None, {"run.fsdp": "true"}).run
    assert resolve_chunk_blocks(run, cuda=False) is None
