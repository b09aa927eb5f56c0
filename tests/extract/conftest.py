"""Tiny in-process targets, tokenizer and chat data for the extract tests (reusable elsewhere).

Everything is built here, never downloaded: a WordLevel tokenizer with a Qwen-like chat
template, a 4-layer Qwen3 and a 4-layer Qwen3.5 hybrid ([linear x 3, full]) saved both as a
multimodal checkpoint, hidden 64.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
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


def save_qwen3(path, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    Qwen3ForCausalLM(Qwen3Config(**_text_kwargs())).save_pretrained(path)
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


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return save_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def qwen3_5_dir(tmp_path_factory):
    return save_qwen3_5(tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="session")
def chats_jsonl(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", make_chats(14))


def run_extract_cfg(model: str, data: str, out: str, **overrides):
    """run_extract on CPU in fp32 with small parts and shards, no progress bar."""
    from dflash.extract.config import ExtractConfig
    from dflash.extract.pipeline import run_extract

    settings = dict(device="cpu", dtype="float32", rows_per_part=5, shard_tokens=16,
                    batch_tokens=96, layers="0,1,3", progress=False)
    settings.update(overrides)
    rank, world = settings.pop("rank", 0), settings.pop("world_size", 1)
    cfg = ExtractConfig(model=model, data=[data], out=out, **settings)
    return run_extract(cfg, rank=rank, world_size=world, echo=lambda *_: None)


def store_samples(url: str) -> list:
    """Every committed sample of a store, part by part, in stored order."""
    from dflash.store_schema import open_store

    return [s for p in open_store(url).parts() for s in p.iter_samples()]


def assert_same_samples(a: list, b: list) -> None:
    assert [s.source_row for s in a] == [s.source_row for s in b]
    for x, y in zip(a, b, strict=True):
        for name in ("input_ids", "loss_mask", "context", "topk_ids", "topk_logits", "lse"):
            assert torch.equal(getattr(x, name), getattr(y, name)), (name, x.source_row)


REPO = Path(__file__).resolve().parents[2]


def cli_args(model: str, data: str, out: str) -> list[str]:
    """The CLI form of run_extract_cfg's settings."""
    return ["--model", model, "--data", data, "--out", out, "--device", "cpu", "--dtype",
            "float32", "--rows-per-part", "5", "--shard-tokens", "16", "--batch-tokens", "96",
            "--layers", "0,1,3", "--no-progress"]


def cli_command(args: list[str]) -> list[str]:
    code = "from dflash.extract.command import extract; extract()"
    return [sys.executable, "-c", code, *args]


def cli_env(**env) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), **env}


def run_cli(args: list[str], **env) -> subprocess.CompletedProcess:
    """`dflash extract ARGS` in a fresh Python process."""
    return subprocess.run(cli_command(args), env=cli_env(**env), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
