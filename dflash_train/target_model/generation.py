"""Replace responses by the target's own continuation (`--regenerate`), greedy or sampled.

Owns batched generation with the KV cache, and counting its progress step by step. Offline
replay equals live speculative decoding only on the target's own text (docs/reference.md §6,
§8a), so the generated ids are used as they are, never detokenized and re-tokenized. At
temperature > 0 each token is the keyed draw of target_model/sampling.py, keyed by the
prompt's sample id and the token's absolute position in its own sequence (padding not
counted): a prompt's answer is the same in any batch, and the same as live sample-and-match
decoding with that seed. Never writes the store.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from dflash_train.target_model.errors import TargetError
from dflash_train.target_model.kv_buffer import buffered_cache
from dflash_train.target_model.sampling import GREEDY, SamplingConfig, perturbed_logits

OnStep = Callable[[int, int], None]
"""Called after every decoding step with (tokens added to rows still running, budget freed by
rows that ended on eos in that step: max_new_tokens minus the tokens they produced)."""


def eos_token_ids(model: nn.Module, tokenizer) -> list[int]:
    """Every id that ends a turn: the generation config's and the tokenizer's eos."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


class _StepCounter(BaseStreamer):
    """What generate hands a streamer, turned into OnStep calls: first the prompts (ignored),
    then each step's next token per row (finished rows get padding, not counted)."""

    def __init__(self, rows: int, max_new_tokens: int, eos_ids: list[int], on_step: OnStep):
        self.running = torch.ones(rows, dtype=torch.bool)
        self.steps, self.max_new_tokens = 0, max_new_tokens
        self.eos = torch.tensor(eos_ids, dtype=torch.long)
        self.on_step = on_step

    def put(self, value: torch.Tensor) -> None:
        if value.dim() > 1:
            return
        self.steps += 1
        if self.steps > self.max_new_tokens:  # a draw past the budget, made only to be dropped
            return
        live = int(self.running.sum())
        ended = self.running & torch.isin(value.long(), self.eos)
        self.running &= ~ended
        self.on_step(live, int(ended.sum()) * (self.max_new_tokens - self.steps))

    def end(self) -> None:
        pass


class _KeyedDraw(LogitsProcessor):
    """Turns generate's greedy step into the keyed sample: argmax of perturbed logits is the
    draw. The drawn token sits at column input_ids.shape[1] of its padded row, so at that
    minus the row's left padding in its own sequence."""

    def __init__(self, cfg: SamplingConfig, sample_ids: list[int], pads: torch.Tensor):
        self.cfg, self.sample_ids, self.pads = cfg, sample_ids, pads

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        positions = input_ids.shape[1] - self.pads
        return perturbed_logits(scores, self.cfg, self.sample_ids, positions)


@torch.inference_mode()
def continuations(model: nn.Module, prompts: list[list[int]], *, max_new_tokens: int,
                  eos_ids: list[int], pad_id: int, sampling: SamplingConfig = GREEDY,
                  sample_ids: list[int] | None = None,
                  on_step: OnStep | None = None) -> list[list[int]]:
    """New tokens for each prompt, up to and including the first eos: greedy, or drawn as
    `sampling` says with prompt b keyed by sample_ids[b] (its data row: stable whatever the
    batching)."""
    device = next(model.parameters()).device
    input_ids, attention_mask, width = left_padded(prompts, pad_id)
    out = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_ids,
        pad_token_id=pad_id, temperature=None, top_p=None, top_k=None,
        logits_processor=keyed_draw(sampling, sample_ids, prompts, width, device),
        streamer=step_counter(len(prompts), max_new_tokens, eos_ids, on_step),
        cache=buffered_cache(model, width + max_new_tokens),
    )
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:cut])
    return answers


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Input ids and attention mask [B, width], left-padded: every prompt ends at the same
    column, so generation appends in step; and that width."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        input_ids[b, width - len(p):] = torch.tensor(p)
        attention_mask[b, width - len(p):] = 1
    return input_ids, attention_mask, width


def step_counter(rows: int, max_new_tokens: int, eos_ids: list[int],
                 on_step: OnStep | None) -> BaseStreamer | None:
    """generate's streamer that calls on_step after every step (None: no streamer)."""
    return None if on_step is None else _StepCounter(rows, max_new_tokens, eos_ids, on_step)


def keyed_draw(cfg: SamplingConfig, sample_ids: list[int] | None, prompts: list[list[int]],
               width: int, device: torch.device) -> LogitsProcessorList | None:
    """None when greedy (generate's own argmax, bit for bit), else the keyed draw."""
    if cfg.greedy:
        return None
    if sample_ids is None or len(sample_ids) != len(prompts):
        raise TargetError(f"sampling at temperature {cfg.temperature} needs one sample id per "
                          f"prompt ({len(prompts)} prompts)")
    pads = torch.tensor([width - len(p) for p in prompts], dtype=torch.long, device=device)
    return LogitsProcessorList([_KeyedDraw(cfg, list(sample_ids), pads)])
