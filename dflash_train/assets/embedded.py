"""Where the embedded default lives in the installed package: the tiny target, the prompts.

Both are written by scripts/train_tiny_target.py (see the target's TRAINING.json for how it
was trained and what it reached). This module only names the files; it never builds them.
"""

from pathlib import Path
from typing import Literal

ASSETS = Path(__file__).resolve().parent
TARGET_DIR = ASSETS / "stdlib_target"
"""The tiny Qwen3.5 hybrid trained on the stdlib: config, bf16 safetensors, tokenizer."""
PROMPTS_DIR = ASSETS / "prompts"
"""The embedded coding prompts: train.jsonl and held_out.jsonl ({"prompt", "response"})."""

Split = Literal["train", "held_out"]


def target_dir() -> Path:
    """The embedded target's directory; FileNotFoundError if the package was built without it."""
    if not (TARGET_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the embedded target is missing from {TARGET_DIR}; "
                                "re-run scripts/train_tiny_target.py")
    return TARGET_DIR


def prompt_file(split: Split = "train") -> Path:
    """The embedded prompt set's `split` as a jsonl path."""
    path = PROMPTS_DIR / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"the embedded prompt set is missing: {path}; "
                                "re-run scripts/train_tiny_target.py")
    return path
