"""What one rank's extract is: its plan, the run that carries the plan out, and the summary of
what it did.

An `ExtractPlan` is all that is known before the model loads or a file is written (the dry
run prints it); an `ExtractRun` adds the store's provenance, the loaded target and the servers.
pipeline.py builds both, in that order (plan_extract, build_extract); fill.py fills the store
with a run. Types only: nothing here reads an input, loads a model or writes a file, the
tokenizer's saved files aside.
"""

import tempfile
from dataclasses import dataclass, field
from functools import cached_property

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from dflash_train.extract.config import CAPTURE_HOST_BYTES, ExtractConfig
from dflash_train.extract.data import ChatSource
from dflash_train.extract.plan import PartPlan, bytes_per_token
from dflash_train.extract.prepare import Counts, Item
from dflash_train.extract.server_generate import Server
from dflash_train.store_schema import StoreMeta, TargetInfo
from dflash_train.store_schema.layout import FP8_CONTEXT
from dflash_train.target_model.loading import Target, tokenizer_files


@dataclass
class ExtractSummary:
    """What a run did, for the closing report."""

    out: str
    parts_done: list[int] = field(default_factory=list)
    parts_already_complete: list[int] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    counts: Counts = field(default_factory=Counts)
    bytes_per_token: int = 0
    store_complete: bool = False
    skipped: list[str] = field(default_factory=list)
    """Where each row skipped by the length policy came from (file:line (row))."""

    def count(self, counts: Counts, source: ChatSource) -> None:
        """Add what the length policy did, each skipped row named where it came from."""
        self.counts.add(counts)
        self.skipped += [source.where(row) for row in counts.skipped_rows]

    def lines(self) -> list[str]:
        c = self.counts
        return [
            f"extracted {self.samples} samples, {self.tokens} tokens into {self.out} "
            f"(~{self.tokens * self.bytes_per_token / 2**20:.1f} MiB before compression)",
            f"parts written: {self.parts_done or 'none'}; already complete: "
            f"{self.parts_already_complete or 'none'}",
            f"truncated: {c.truncated}; skipped overlong: {c.skipped_overlong}; "
            f"skipped with no assistant token within max-length: {c.skipped_no_assistant}"
            + (f"; skipped rows: {_listed(self.skipped)}" if self.skipped else ""),
            "store complete" if self.store_complete else "store not complete yet "
            "(other ranks still running, or re-run the same command to resume)",
        ]


def _listed(where: list[str], limit: int = 5) -> str:
    if not where:
        return ""
    more = f" and {len(where) - limit} more" if len(where) > limit else ""
    return f"{'; '.join(where[:limit])}{more}"


@dataclass(kw_only=True)
class ExtractPlan:
    """What this rank extracts, every input row checked, all known before the model loads or
    a file is written: the dry run prints it, build_extract loads the target to carry it out."""

    cfg: ExtractConfig
    """The settings, with the embedded prompts as `data` when none was given."""
    rank: int
    world: int
    """Processes extracting together (WORLD_SIZE); rank r takes parts r, r + world, ..."""
    source: ChatSource
    tokenizer: PreTrainedTokenizerBase
    model_config: PretrainedConfig
    """The target's config as read, before any weight is loaded."""
    info: TargetInfo
    layer_ids: list[int]
    """Target layers whose states are stored as context."""
    parts: list[PartPlan]
    """Every part of the store."""
    mine: list[PartPlan]
    """The parts this rank fills (a dry run plans them all)."""
    scanned: list[Item]
    """The rows of `mine` the length policy keeps, rendered (prompts, with regenerate)."""
    dtype: torch.dtype
    """Compute and storage dtype of the hidden states."""

    @property
    def fp8(self) -> bool:
        return self.cfg.context_dtype == FP8_CONTEXT

    @property
    def bytes_per_token(self) -> int:
        """Uncompressed store bytes per token (with fp8: one byte a value, plus its scales)."""
        layers = len(self.layer_ids)
        hidden = 1 if self.fp8 else self.dtype.itemsize
        return (bytes_per_token(layers, self.info.hidden_size, hidden, self.cfg.top_k)
                + (4 * layers if self.fp8 else 0))

    @cached_property
    def captures_in_generation(self) -> bool:
        """Whether the built-in generation's own states are stored (ExtractConfig.capture):
        decided by the settings alone, so every rank and every resume decides alike."""
        cfg = self.cfg
        if not cfg.regenerate or cfg.servers or cfg.capture == "forward":
            return False
        if cfg.capture == "generation":
            return True
        longest = cfg.max_length - 1 + cfg.max_new_tokens  # a prompt that fits, all answered
        held = bytes_per_token(len(self.layer_ids), self.info.hidden_size,
                               self.dtype.itemsize, cfg.top_k)
        return cfg.rows_per_part * longest * held <= CAPTURE_HOST_BYTES

    @cached_property
    def budgets(self) -> dict[int, int]:
        """The most tokens each kept row can take: its rendering, and with regenerate the
        answer's max-new-tokens (the progress bars' totals)."""
        answer = self.cfg.max_new_tokens if self.cfg.regenerate else 0
        return {i.row: len(i.input_ids) + answer for i in self.scanned}

    def budget(self, part: PartPlan) -> int:
        return sum(self.budgets.get(row, 0) for row in range(part.row_start, part.row_stop))

    @cached_property
    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer as saved files: hashed into the provenance, copied into the store."""
        with tempfile.TemporaryDirectory() as tmp:
            return tokenizer_files(self.tokenizer, tmp)


@dataclass(kw_only=True)
class ExtractRun:
    """A plan with what carries it out, built once by build_extract: the provenance its store
    is made with, the loaded target and the servers that generate for it."""

    plan: ExtractPlan
    meta: StoreMeta
    """The store's provenance (a store already at --out holds the same)."""
    target: Target
    servers: list[Server]
    """--server URLs checked to serve the target; empty: the target itself generates."""
