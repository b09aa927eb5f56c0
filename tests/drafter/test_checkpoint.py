"""The serving directory format: round trip, published fields and key names, export."""

import contextlib
import hashlib
import json
import os
import stat
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import dflash_train.drafter.checkpoint as checkpoint
import dflash_train.drafter.files as files
from dflash_train.drafter import (
    DRAFTER_SUBDIR,
    DFlashDrafter,
    DrafterConfig,
    DrafterError,
    export_checkpoint,
    load_drafter,
    read_drafter_config,
    save_drafter,
)
from dflash_train.drafter.hf_config import config_to_dict, drafter_config_from_dict

from .conftest import random_batch, tiny_drafter

# z-lab/Qwen3-8B-DFlash-b16 config.json, written by hand from public sources:
# - shape, ids, mask, block_size, auto_map, num_target_layers: the source config in
#   vllm-project/speculators tests (convert/dflash test_converter, `_source_config`);
# - the remaining field set and their values as z-lab writes them (transformers 4.57 dump
#   of a DFlashDraftModel b16 config: attention_*, max_window_layers, rope_scaling null,
#   sliding_window null, use_sliding_window false, layer_types): a public SLURM script that
#   embeds the z-lab/Qwen3-4B-DFlash-b16 config verbatim, with Qwen3-8B's target values
#   (rope_theta 1e6, 40960 positions, untied embeddings, bos/eos ids);
# - key names: z-lab/dflash dflash/model.py (DFlashDraftModel) and vLLM
#   vllm/model_executor/models/qwen3_dflash.py (load_weights prefixes "model." to them).
ZLAB_QWEN3_8B_B16 = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.3",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_8B_TARGET = {"hidden_size": 4096, "intermediate_size": 12288, "vocab_size": 151936,
                   "num_hidden_layers": 36, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
                   "max_position_embeddings": 40960}
# Fixture fields we do not write, and why: tokenizer ids belong to the target (engines read
# them from the target), the library version is whatever wrote the file.
NOT_WRITTEN = {"bos_token_id", "eos_token_id", "transformers_version"}
# Fields we write beyond the b16 fixture: docs/reference.md §9 puts block_size in dflash_config
# too (the newer z-lab checkpoints do), and z-lab's loader reads it there first.
ADDED = {"dflash_config.block_size"}
# Fields we write with another value: auto_map names the loader module we ship beside the
# weights (z-lab ship their own dflash.py on the Hub; naming it without the file made
# AutoModel(trust_remote_code=True) fail). Engines resolve the drafter by architectures.
CHANGED = {"auto_map": {"AutoModel": "modeling_dflash_train.AutoModelLoader"}}
OWN_FILES = ["checksums.json", "config.json", "model.safetensors", "modeling_dflash_train.py"]

# The per-layer tensors of a published DFlash checkpoint, as its safetensors header lists them.
LAYER_KEYS = [
    "input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "post_attention_layernorm.weight", "self_attn.k_norm.weight",
    "self_attn.k_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
    "self_attn.q_proj.weight", "self_attn.v_proj.weight",
]


def _published_keys(num_layers):
    layers = [f"layers.{i}.{key}" for i in range(num_layers) for key in LAYER_KEYS]
    return sorted(["fc.weight", "hidden_norm.weight", "norm.weight", *layers])


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _flatten(raw, prefix=""):
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict) and key == "dflash_config":
            out.update(_flatten(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


def test_save_load_round_trip_is_bit_exact(tmp_path):
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_drafter(0, is_causal=True).to(dtype)
        out = save_drafter(model, tmp_path / str(dtype))
        loaded = load_drafter(out)
        assert loaded.config == model.config
        want, got = model.state_dict(), loaded.state_dict()
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == dtype
            assert torch.equal(_bits(got[name]), _bits(want[name])), name


def test_loaded_drafter_computes_the_same_logits(tmp_path):
    model = tiny_drafter(1)
    loaded = load_drafter(save_drafter(model, tmp_path / "d"))
    loaded.attach_target_head(model.target_embed_tokens, model.target_lm_head)
    batch = random_batch(model, 1)
    with torch.no_grad():
        assert torch.equal(loaded.forward_logits(*batch), model.forward_logits(*batch))


def test_exported_config_matches_the_published_format_field_by_field():
    config = DrafterConfig.for_target(QWEN3_8B_TARGET, mask_token_id=151669)
    ours = _flatten(config_to_dict(config, torch.bfloat16))
    published = _flatten(ZLAB_QWEN3_8B_B16)
    for field, value in published.items():
        if field in NOT_WRITTEN:
            assert field not in ours
            continue
        assert field in ours, f"published field {field} not written"
        value = CHANGED.get(field, value)
        assert ours[field] == value and type(ours[field]) is type(value), field
    assert set(ours) - set(published) == ADDED
    assert ours["dflash_config.block_size"] == 16


def test_saved_weights_have_the_published_key_names(tmp_path):
    model = tiny_drafter(0, num_hidden_layers=3,
                         layer_types=["sliding_attention"] * 2 + ["full_attention"])
    out = save_drafter(model, tmp_path / "d")
    assert sorted(load_file(str(out / "model.safetensors"))) == _published_keys(3)
    assert sorted(p.name for p in out.iterdir()) == OWN_FILES


def test_published_shapes_follow_from_the_config():
    # The 27B drafter's fc is Linear(5 * 5120 -> 5120); k/v project to 8 heads of 128.
    with torch.device("meta"):
        model = DFlashDrafter(DrafterConfig.qwen3_6_27b())
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert sorted(shapes) == _published_keys(5)
    assert shapes["fc.weight"] == (5120, 25600)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (4096, 5120)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (1024, 5120)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["layers.0.mlp.gate_proj.weight"] == (17408, 5120)


def test_third_party_zlab_checkpoint_loads(tmp_path):
    # A z-lab-format directory (their field set, flat rope_theta, block_size at top level),
    # shrunk to a tiny shape, with weights under the published key names.
    raw = {**ZLAB_QWEN3_8B_B16, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": 100, "layer_types": ["full_attention"] * 2,
           "dflash_config": {"mask_token_id": 99, "target_layer_ids": [1, 9, 17, 25, 33]}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        reference = DFlashDrafter(drafter_config_from_dict(raw))
    shapes = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert shapes["fc.weight"] == (64, 5 * 64)
    tensors = {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = load_drafter(tmp_path)
    assert model.config.block_size == 16 and model.config.rope_theta == 1e6
    assert model.config.target_layer_ids == [1, 9, 17, 25, 33]
    assert [model.config.layer_is_causal(i) for i in range(2)] == [False, False]
    assert torch.equal(model.state_dict()["fc.weight"], tensors["fc.weight"])


def test_rope_parameters_and_is_causal_of_newer_configs_are_read():
    raw = {**_tiny_raw_config(), "rope_parameters": {"rope_theta": 1e7, "rope_type": "default"},
           "is_causal": False, "layer_types": ["sliding_attention"] * 2, "sliding_window": 2048}
    del raw["rope_theta"]
    cfg = drafter_config_from_dict(raw)
    assert cfg.rope_theta == 1e7
    assert [cfg.layer_is_causal(i) for i in range(2)] == [False, False]


def _tiny_raw_config():
    return config_to_dict(tiny_drafter(0).config, torch.float32)


@pytest.mark.parametrize("change, words", [
    ({"architectures": ["Eagle3DraftModel"]}, "architectures"),
    ({"architectures": ["DFlash2DraftModel"]}, "needs dflash_config.conv_kernel_size"),
    ({"model_type": "minimax_m2"}, "model_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type"),
    ({"dflash_config": {"mask_token_id": 99, "target_layer_ids": [1, 3, 5],
                        "selector_rank": 256}}, "selector_rank"),
    ({"dflash_config": {"mask_token_id": 99, "target_layer_ids": [1, 3, 5],
                        "output_multiplier": 0.2}}, "output_multiplier"),
    ({"dflash_config": {"mask_token_id": 99}}, "target_layer_ids"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_checkpoints_are_refused_by_name(tmp_path, change, words):
    raw = {**_tiny_raw_config(), **change}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterError, match=words):
        read_drafter_config(tmp_path)


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path):
    out = save_drafter(tiny_drafter(0), tmp_path / "d")
    (out / "checksums.json").unlink()  # hand-made weights, as in a third-party directory
    tensors = load_file(str(out / "model.safetensors"))
    cases = [
        ({**tensors, "lm_head.weight": torch.zeros(100, 64)}, "own embed_tokens/lm_head"),
        ({k: v for k, v in tensors.items() if k != "norm.weight"}, "missing weights"),
        ({**tensors, "fc.weight": torch.zeros(64, 128)}, "fc.weight has shape"),
    ]
    for state, words in cases:
        save_file(state, str(out / "model.safetensors"))
        with pytest.raises(DrafterError, match=words):
            load_drafter(out)
    (out / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(DrafterError, match="cannot read safetensors"):
        load_drafter(out)


def test_export_writes_bf16_serving_dir_from_a_training_checkpoint(tmp_path):
    model = tiny_drafter(0)
    ckpt = tmp_path / "checkpoints" / "step_100"
    save_drafter(model, ckpt / DRAFTER_SUBDIR)
    (ckpt / "optimizer.pt").write_bytes(b"optimiser state, not exported")
    (ckpt / "COMPLETE").write_text("step 100\n")  # a whole checkpoint: its marker is there
    out = export_checkpoint(ckpt, tmp_path / "serve")
    assert sorted(p.name for p in out.iterdir()) == OWN_FILES
    raw = json.loads((out / "config.json").read_text())
    assert raw["dtype"] == "bfloat16"
    assert drafter_config_from_dict(raw) == model.config
    exported = load_drafter(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor.to(torch.bfloat16)), name


def test_exported_config_parses_as_a_transformers_qwen3_config(tmp_path):
    # z-lab's DFlashDraftModel and vLLM both read config.json through Qwen3Config.
    from transformers import AutoConfig

    model = tiny_drafter(0, is_causal=False)
    hf = AutoConfig.from_pretrained(save_drafter(model, tmp_path / "d"))
    assert type(hf).__name__ == "Qwen3Config"
    assert hf.layer_types == model.config.layer_types
    assert hf.sliding_window == model.config.sliding_window
    assert hf.rope_parameters["rope_theta"] == model.config.rope_theta
    assert hf.dflash_config["target_layer_ids"] == model.config.target_layer_ids
    assert hf.is_causal is False


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    out = save_drafter(tiny_drafter(0), tmp_path / "d")
    with pytest.raises(DrafterError, match="already exists"):
        save_drafter(tiny_drafter(1), out)
    save_drafter(tiny_drafter(1), out, overwrite=True)
    assert torch.equal(load_drafter(out).fc.weight, tiny_drafter(1).fc.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_a_failed_write_leaves_no_directory_behind(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(DrafterError, match="cannot write it: disk full"):  # one line
        save_drafter(tiny_drafter(0), tmp_path / "d")
    assert list(tmp_path.iterdir()) == []
    # An existing drafter survives a failed overwrite untouched.
    monkeypatch.undo()
    out = save_drafter(tiny_drafter(0), tmp_path / "d")
    before = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(DrafterError, match="disk full"):
        save_drafter(tiny_drafter(1), out, overwrite=True)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(DrafterError, match="nowhere: does not exist"):
        load_drafter(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DrafterError, match="empty: no config.json here or in drafter/"):
        load_drafter(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(DrafterError, match="file: is a file"):
        load_drafter(tmp_path / "file")


def _flip_bytes(path, at=None):
    """XOR 8 bytes in the middle of the file (the tensor data of a safetensors file)."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i : i + 8] = bytes(b ^ 0x5A for b in data[i : i + 8])
    path.write_bytes(bytes(data))


def test_the_checksum_record_holds_the_sha256_of_every_file_written(tmp_path):
    out = save_drafter(tiny_drafter(0), tmp_path / "d")
    record = json.loads((out / "checksums.json").read_text())
    assert record["algorithm"] == "sha256"
    assert record["files"] == {
        name: hashlib.sha256((out / name).read_bytes()).hexdigest()
        for name in OWN_FILES if name != "checksums.json"}


def test_flipped_weight_bytes_are_refused_naming_the_file(tmp_path):
    model = tiny_drafter(0)
    ckpt = tmp_path / "step_1"
    out = save_drafter(model, ckpt / DRAFTER_SUBDIR)
    (ckpt / "COMPLETE").write_text("step 1\n")
    _flip_bytes(out / "model.safetensors")
    # The flip lies in tensor data: safetensors itself reads the file without complaint.
    flipped = load_file(str(out / "model.safetensors"))
    assert any(not torch.equal(flipped[k], v) for k, v in model.state_dict().items()
               if k in flipped)
    for path in (out, ckpt):
        with pytest.raises(DrafterError, match=r"model\.safetensors: sha256 .* does not match"):
            load_drafter(path)
    with pytest.raises(DrafterError, match="model.safetensors"):
        export_checkpoint(ckpt, tmp_path / "serve")
    assert not (tmp_path / "serve").exists()


def test_an_edited_config_or_a_missing_listed_file_is_refused(tmp_path):
    out = save_drafter(tiny_drafter(0), tmp_path / "d")
    config = (out / "config.json").read_text()
    (out / "config.json").write_text(config.replace('"num_hidden_layers": 2',
                                                    '"num_hidden_layers": 3'))
    with pytest.raises(DrafterError, match="config.json: sha256"):
        load_drafter(out)
    (out / "config.json").write_text(config)
    assert load_drafter(out).config == tiny_drafter(0).config
    (out / "model.safetensors").unlink()
    with pytest.raises(DrafterError, match="model.safetensors: listed in checksums.json"):
        load_drafter(out)


def test_a_directory_without_a_checksum_record_still_loads(tmp_path):
    # z-lab / HF downloads and older checkpoints carry no record: loaded unverified.
    model = tiny_drafter(0)
    out = save_drafter(model, tmp_path / "d")
    (out / "checksums.json").unlink()
    loaded = load_drafter(out)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_unknown_num_target_layers_is_left_out_of_the_export_not_written_null(tmp_path):
    src = save_drafter(tiny_drafter(0), tmp_path / "zlab")
    raw = json.loads((src / "config.json").read_text())
    assert raw["num_target_layers"] == 8
    del raw["num_target_layers"]
    (src / "config.json").write_text(json.dumps(raw))
    (src / "checksums.json").unlink()  # a third-party directory has none
    out = export_checkpoint(src, tmp_path / "serve")
    exported = json.loads((out / "config.json").read_text())
    assert "num_target_layers" not in exported
    assert read_drafter_config(out).num_target_layers is None
    assert exported["dflash_config"]["target_layer_ids"] == [1, 3, 5]


def _user_dirs(tmp_path):
    """Directories an overwrite must never delete, and the files each holds."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("years of work")
    run = tmp_path / "run1"
    save_drafter(tiny_drafter(0), run / "checkpoints" / "step_2" / DRAFTER_SUBDIR)
    (run / "log.jsonl").write_text("{}\n")
    # config.json + model.safetensors, but of another model: not a DFlash export.
    other = tmp_path / "qwen3"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    (other / "model.safetensors").write_bytes(b"target weights")
    # a previous export plus one file of the user's
    mixed = save_drafter(tiny_drafter(0), tmp_path / "mixed")
    (mixed / "README.md").write_text("my notes")
    return [notes, run, other, mixed]


def _tree(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_overwrite_never_replaces_a_directory_that_is_not_a_previous_export(tmp_path):
    src = save_drafter(tiny_drafter(1), tmp_path / "src")
    for target in _user_dirs(tmp_path):
        before = _tree(target)
        with pytest.raises(DrafterError) as info:
            export_checkpoint(src, target, overwrite=True)
        message = str(info.value)
        assert str(target) in message and "refusing to replace" in message
        assert sorted(p.name for p in target.iterdir())[0] in message
        assert "\n" not in message
        assert _tree(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed", "notes", "qwen3", "run1",
                                                          "src"]


def test_overwrite_replaces_an_empty_directory_or_a_previous_export(tmp_path):
    src = save_drafter(tiny_drafter(1), tmp_path / "src")
    empty = tmp_path / "empty"
    empty.mkdir()
    previous = export_checkpoint(save_drafter(tiny_drafter(0), tmp_path / "old"),
                                 tmp_path / "previous")
    for target in (empty, previous):
        out = export_checkpoint(src, target, overwrite=True, dtype=None)
        assert torch.equal(load_drafter(out).fc.weight, tiny_drafter(1).fc.weight)


def test_export_refuses_to_write_over_its_own_source(tmp_path):
    ckpt = tmp_path / "step_1"
    src = save_drafter(tiny_drafter(0), ckpt / DRAFTER_SUBDIR)
    before = _tree(ckpt)
    for target in (ckpt, src):
        with pytest.raises(DrafterError, match="is the checkpoint being exported"):
            export_checkpoint(ckpt, target, overwrite=True)
    assert _tree(ckpt) == before


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


@contextlib.contextmanager
def _umask(mask):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755),
                                                       (0o077, 0o600, 0o700)])
def test_saved_and_exported_drafters_get_the_modes_the_umask_gives(tmp_path, mask, file_mode,
                                                                   dir_mode):
    # A server running as another user (or in a container) reads the export: it must not
    # stay as private as the temp dir and safetensors' own file (0700 / 0600) whatever the
    # umask, nor be opener than the umask allows.
    with _umask(mask):
        saved = save_drafter(tiny_drafter(0), tmp_path / "saved")
        exported = export_checkpoint(saved, tmp_path / "export")
        again = export_checkpoint(saved, exported, overwrite=True)
        (tmp_path / "plain").write_text("")  # what the umask gives any new file
    assert _mode(tmp_path / "plain") == file_mode
    for directory in (saved, exported, again):
        assert _mode(directory) == dir_mode, directory
        files = sorted(directory.iterdir())
        assert len(files) >= 3
        assert {p.name: _mode(p) for p in files} == {p.name: file_mode for p in files}


def test_the_umask_is_read_where_the_kernel_does_not_report_it(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "PROC_STATUS", tmp_path / "no-proc")
    with _umask(0o027):
        assert files.new_file_modes() == (0o640, 0o750)
        assert os.umask(0o027) == 0o027  # left as it was


# -- what transformers' AutoModel makes of an export ---------------------------------------


@pytest.fixture
def hf_modules(tmp_path, monkeypatch):
    """transformers copies remote code into its modules cache and imports it from there:
    a cache of this test's own, and the modules it imported forgotten afterwards."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("transformers_modules"):
            del sys.modules[name]


def _export(tmp_path, name, model, dtype=None):
    return export_checkpoint(save_drafter(model, tmp_path / f"{name}-src"), tmp_path / name,
                             dtype=dtype)


def test_automodel_with_remote_code_gives_our_drafter_and_its_logits(tmp_path, hf_modules):
    from transformers import AutoModel

    model = tiny_drafter(3)
    fp32 = _export(tmp_path, "fp32", model)
    loaded = AutoModel.from_pretrained(fp32, trust_remote_code=True, device_map="cpu")
    assert isinstance(loaded, DFlashDrafter) and not loaded.training
    assert loaded.config == model.config
    loaded.attach_target_head(model.target_embed_tokens, model.target_lm_head)
    batch = random_batch(model, 3)
    with torch.no_grad():
        assert torch.equal(loaded.forward_logits(*batch), model.forward_logits(*batch))
    # The served bf16 export: dtype "auto" keeps bf16, a dtype casts as load_drafter does.
    bf16 = _export(tmp_path, "bf16", model, dtype=torch.bfloat16)
    auto = AutoModel.from_pretrained(bf16, trust_remote_code=True, dtype="auto")
    assert auto.fc.weight.dtype == torch.bfloat16
    up = AutoModel.from_pretrained(bf16, trust_remote_code=True, torch_dtype=torch.float32)
    assert torch.equal(up.fc.weight, model.fc.weight.to(torch.bfloat16).float())
    with pytest.raises(TypeError, match="not low_cpu_mem_usage"):
        AutoModel.from_pretrained(bf16, trust_remote_code=True, low_cpu_mem_usage=True)
    with pytest.raises(TypeError, match="pass one device"):
        AutoModel.from_pretrained(bf16, trust_remote_code=True, device_map="auto")


def test_automodel_remote_code_without_dflash_train_says_what_to_install(tmp_path, hf_modules,
                                                                         monkeypatch):
    from transformers import AutoModel

    out = _export(tmp_path, "elsewhere", tiny_drafter(0))
    # As where dflash-train is not installed: the shipped module's one import fails.
    monkeypatch.setitem(sys.modules, "dflash_train.drafter.checkpoint", None)
    with pytest.raises(ImportError, match=r"modeling_dflash_train\.py: .*install dflash-train"):
        AutoModel.from_pretrained(out, trust_remote_code=True)


def test_automodel_without_remote_code_builds_transformers_qwen3_and_reports_it(tmp_path,
                                                                               hf_modules):
    # What we cannot prevent: config.json says model_type qwen3, which vLLM, SGLang and
    # z-lab's loader all read, so transformers' own Qwen3Model is built from it. It is not
    # silent: its load report names the drafter's own weights as unexpected and the
    # embedding (which the drafter borrows from the target) as missing.
    from transformers import AutoModel, Qwen3Model

    out = _export(tmp_path, "plain", tiny_drafter(0))
    model, info = AutoModel.from_pretrained(out, output_loading_info=True)
    assert type(model) is Qwen3Model
    assert info["unexpected_keys"] == {"fc.weight", "hidden_norm.weight"}
    assert info["missing_keys"] == {"embed_tokens.weight"}
