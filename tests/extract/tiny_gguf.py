"""A tiny random-weight Llama written as a real GGUF file with the `gguf` package, and the same
weights as a transformers (safetensors) checkpoint.

What llama.cpp's converter does and the reader must undo: tensors renamed to llama.cpp's
names, q/k rows permuted (llama.cpp's rotary layout pairs dimensions i and i + d/2 the other
way round), matrices quantized (Q8_0 here: 32 values share one fp16 scale), norms in f32,
the tied lm_head left out, and the tokenizer stored as metadata (byte-level BPE tokens,
token types, merges, special ids, chat template). The reference checkpoint holds the
dequantized values, so both must give the same logits exactly.
"""

import json

import numpy as np
import torch

from dflash_train.assets.tiny import CHAT_TEMPLATE, VOCAB_SIZE, build_tokenizer

LLAMA = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
             rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=True,
             initializer_range=0.2, bos_token_id=2, eos_token_id=3, pad_token_id=0)
"""SmolLM2's shape in miniature: grouped-query attention, tied embeddings."""

_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<module>.weight
    return f"blk.{layer}.{_NAMES[rest.removesuffix('.weight')]}.weight"


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the two rotary halves interleaved."""
    return (rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


def random_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()


def write_tiny_gguf(path, hf_dir=None, seed: int = 0, name: str = "tiny-llama",
                    matrices: str = "Q8_0") -> str:
    """Write the GGUF at `path`, its matrices `matrices` ("Q8_0", or "F32" where llama.cpp must
    compute what transformers computes: it multiplies Q8_0 weights by Q8_0-rounded
    activations); with `hf_dir`, the dequantized weights as safetensors there (with the
    tokenizer transformers builds from the GGUF)."""
    import gguf

    kind = gguf.GGMLQuantizationType[matrices]

    model = random_llama(seed)
    tokens = _tokenizer_metadata()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_block_count(LLAMA["num_hidden_layers"])
    writer.add_context_length(LLAMA["max_position_embeddings"])
    writer.add_embedding_length(LLAMA["hidden_size"])
    writer.add_feed_forward_length(LLAMA["intermediate_size"])
    writer.add_head_count(LLAMA["num_attention_heads"])
    writer.add_head_count_kv(LLAMA["num_key_value_heads"])
    writer.add_rope_dimension_count(LLAMA["head_dim"])
    writer.add_rope_freq_base(LLAMA["rope_theta"])
    writer.add_layer_norm_rms_eps(LLAMA["rms_norm_eps"])
    writer.add_vocab_size(LLAMA["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if matrices == "F32"
                         else gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")  # the split regex the tiny BPE was trained with
    writer.add_token_list(tokens["tokens"])
    writer.add_token_types(tokens["types"])
    writer.add_token_merges(tokens["merges"])
    for key in ("bos", "eos", "pad"):
        getattr(writer, f"add_{key}_token_id")(LLAMA[f"{key}_token_id"])
    writer.add_unk_token_id(tokens["unk"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    reference = {}
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight":
            continue  # tied: the reader takes the embedding
        w = tensor.float().numpy()
        if w.ndim == 1:
            writer.add_tensor(gguf_name(hf), w)
            reference[hf] = w
            continue
        q = gguf.quants.quantize(w, kind)  # [rows, bytes per row]; F32: the values
        reference[hf] = gguf.quants.dequantize(q, kind)
        if hf.endswith("q_proj.weight"):
            q = llama_cpp_permute(q, LLAMA["num_attention_heads"])
        elif hf.endswith("k_proj.weight"):
            q = llama_cpp_permute(q, LLAMA["num_key_value_heads"])
        writer.add_tensor(gguf_name(hf), q, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if hf_dir is not None:
        _save_reference(model, reference, path, hf_dir)
    return str(path)


def _tokenizer_metadata() -> dict:
    """The tiny BPE as GGUF metadata, its vocabulary padded to the model's rows with unused
    control tokens (as Llama 3's reserved tokens pad its vocabulary)."""
    import gguf

    tok = build_tokenizer()
    vocab = tok.get_vocab()
    by_id = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in by_id] == list(range(len(by_id)))
    special = set(tok.all_special_tokens)
    pad = [f"<|unused_{i}|>" for i in range(VOCAB_SIZE - len(by_id))]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    return {
        "tokens": by_id + pad,
        "types": [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                  for t in by_id] + [gguf.TokenType.CONTROL] * len(pad),
        "merges": [m if isinstance(m, str) else " ".join(m) for m in merges],
        "unk": vocab["<unk>"],
    }


def _save_reference(model, reference: dict, gguf_path, hf_dir) -> None:
    from transformers import AutoTokenizer

    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in reference.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)
    model.tie_weights()
    model.save_pretrained(hf_dir)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(hf_dir)
