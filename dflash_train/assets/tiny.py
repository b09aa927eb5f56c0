"""A tiny random-weight target built in process: tokenizer, Qwen3 / Qwen3.5 checkpoints, chats.

Used by the tests and by examples/tiny_pipeline.py so the whole pipeline runs on a CPU with
no download. The weights are random: a real target that ships with dflash is a separate asset.
"""

import json
import random

import torch

WORDS = ("the a cat dog sat on mat hello world how are you fine thanks what is two plus "
         "three five yes no red blue green big small run jump").split()
SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
ROLE_WORDS = ["system", "user", "assistant", "tool"]
TOKENIZER_VOCAB = 330
VOCAB_SIZE = 344
"""Model vocab; larger than the tokenizer's, as for real targets (340..343: vision ids)."""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(chat_template: str = CHAT_TEMPLATE):
    """A byte-level BPE (Qwen's pre-tokenizer) trained on WORDS, as Qwen3_5Tokenizer.

    transformers 5 rebuilds a qwen3 / qwen3_5 checkpoint's tokenizer from vocab + merges with
    Qwen's own pre-tokenizer, so the fixture must be such a BPE to survive save / load.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [" ".join(WORDS)] * 3 + ["\n".join(ROLE_WORDS)] + [" " + w for w in WORDS]
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    tok = Qwen3_5Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]],
                           unk_token="<unk>", eos_token="<|im_end|>", pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|mask|>"]})
    tok.chat_template = chat_template
    return tok


def _text_kwargs() -> dict:
    return dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                initializer_range=0.2, pad_token_id=0, eos_token_id=3)


def save_qwen3(path, seed: int = 0, **overrides):
    """overrides: Qwen3Config fields, e.g. head_dim=32 for vLLM's CPU attention (16 fails)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    Qwen3ForCausalLM(Qwen3Config(**{**_text_kwargs(), **overrides})).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def save_qwen3_5(path, seed: int = 0):
    """A Qwen3.5 hybrid saved as the multimodal checkpoint (as Qwen3.6-27B ships)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(_text_kwargs(), linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                layer_types=["linear_attention"] * 3 + ["full_attention"])
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1,
                  num_position_embeddings=16)
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=340,
                           video_token_id=341, vision_start_token_id=342,
                           vision_end_token_id=343)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def make_chats(n: int, seed: int = 0) -> list[dict]:
    """Rows of varied length: chats (some multi-turn, some with a system turn) and pairs."""
    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    rows = []
    for i in range(n):
        if i % 4 == 3:
            rows.append({"prompt": text(2, 8), "response": text(1, 12)})
            continue
        messages = [{"role": "system", "content": text(1, 4)}] if i % 3 == 0 else []
        for _ in range(1 + (i % 5 == 1)):
            messages += [{"role": "user", "content": text(2, 10)},
                         {"role": "assistant", "content": text(1, 14)}]
        rows.append({"messages": messages})
    return rows


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)
