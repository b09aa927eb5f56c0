"""Generation that keeps what the target computed on the way: the selected layers' states and
the verifier's top-k at every token of prompt + answer, so extract --regenerate needs no
second forward over the same tokens (on SmolLM2 that forward was ~40 % of extract's time).

Owns running `generate` with hooks. The answers are generate's own (the same call, the same
batches, the same keyed draw as generation.continuations), so the tokens are the ones the
plain path makes; only the stopping differs, which no row's tokens depend on (every GEMM row
and attention row of a batch is computed apart from the others):
- a row's last token must itself be fed once, for its states, so generate runs up to
  max_new_tokens + 1 and a row stops only after its eos was fed; the extra draw is dropped;
- generate's own eos stop would end the batch before the last eos is fed: its criterion is
  replaced by one on an id no draw returns, and `_EosFed` stops rows instead (the eos ids stay
  in the config, for whatever the model's own generation settings do with them).
Where each value comes from: the prompt's states and top-k from the prefill (top-k through
verifier_topk, as the capture forward computes it); an answer token's states from the step
that fed it, its top-k from the head's output in that step (the logits its own successor was
drawn from, before any processor of the model's generation config). Never writes a file.
"""

import logging
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)

from dflash_train.target_model.capture import hooked_layers
from dflash_train.target_model.errors import TargetError
from dflash_train.target_model.generation import OnStep, keyed_draw, left_padded, step_counter
from dflash_train.target_model.kv_buffer import buffered_cache
from dflash_train.target_model.loading import Target
from dflash_train.target_model.sampling import GREEDY, SamplingConfig
from dflash_train.target_model.verifier import topk_of_logits, verifier_topk


@dataclass
class TokenStates:
    """What the target computed at each of n tokens, as a capture forward stores it."""

    context: torch.Tensor
    """[n, layers, H] in the target's dtype, on the host."""
    topk_ids: torch.Tensor
    """[n, k] int32, argmax first."""
    topk_logits: torch.Tensor
    """[n, k] float32."""
    lse: torch.Tensor
    """[n] float32."""

    def first(self, n: int) -> "TokenStates":
        """The first n tokens' (causal: what a sequence cut after n tokens would give), copied
        so that the rest is freed."""
        return TokenStates(self.context[:n].clone(), self.topk_ids[:n].clone(),
                           self.topk_logits[:n].clone(), self.lse[:n].clone())


@dataclass(frozen=True)
class StatesToKeep:
    """What generate_with_states keeps of each token."""

    layer_ids: list[int]
    """The context layers whose outputs are kept."""
    top_k: int
    """Verifier top-k logits kept per token."""


class _EosFed(StoppingCriteria):
    """A row is done once an eos it generated has been fed back (it is no longer the last
    column)."""

    def __init__(self, width: int, eos_ids: list[int]):
        self.width = width
        self.eos = torch.tensor(eos_ids, dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        fed = input_ids[:, self.width:-1]
        return torch.isin(fed, self.eos.to(fed.device)).any(dim=-1)


@torch.inference_mode()
def generate_with_states(target: Target, prompts: list[list[int]], keep: StatesToKeep, *,
                         max_new_tokens: int, eos_ids: list[int], pad_id: int,
                         sampling: SamplingConfig = GREEDY,
                         sample_ids: list[int] | None = None,
                         on_step: OnStep | None = None
                         ) -> list[tuple[list[int], TokenStates]]:
    """The answers generation.continuations gives for `prompts`, each with the states of its
    prompt + answer tokens."""
    model, device = target.model, target.device
    layer_ids, top_k = keep.layer_ids, keep.top_k
    input_ids, attention_mask, width = left_padded(prompts, pad_id)
    config = _generation_config(model, max_new_tokens, eos_ids, pad_id)
    forwards: list[torch.Tensor] = []  # per decoder forward: [B, T, layers, H] on the host
    step_topk: list[tuple[torch.Tensor, ...]] = []  # per forward: the last position's
    prompt_topk: list = []

    def keep_states(_decoder, _args, output) -> None:
        states = torch.stack([captured[k] for k in layer_ids], dim=2)
        if not forwards:  # the prefill: the prompt tokens' top-k, as the capture forward's
            final = output.last_hidden_state[attention_mask.to(device).bool()]
            prompt_topk.append(verifier_topk(final, target.lm_head, top_k))
        forwards.append(states.cpu())

    def keep_topk(_head, _args, logits) -> None:
        # the head's own output, before any processor generate adds from the model's config
        step_topk.append(tuple(t.cpu() for t in topk_of_logits(logits[:, -1].float(), top_k)))

    stop = StoppingCriteriaList([_EosFed(width, eos_ids),
                                 EosTokenCriteria(target.lm_head.weight.shape[0])])
    with hooked_layers(target.decoder.layers, layer_ids) as captured, _quiet_generate():
        handles = [target.decoder.register_forward_hook(keep_states),
                   target.lm_head.register_forward_hook(keep_topk)]
        try:
            out = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                generation_config=config, stopping_criteria=stop,
                logits_processor=keyed_draw(sampling, sample_ids, prompts, width, device),
                streamer=step_counter(len(prompts), max_new_tokens, eos_ids, on_step),
                cache=buffered_cache(model, width + max_new_tokens + 1))
        finally:
            for h in handles:
                h.remove()
    return _per_prompt(prompts, out[:, width:].cpu(), forwards, prompt_topk[0], step_topk,
                       max_new_tokens, eos_ids, width)


def _generation_config(model, max_new_tokens: int, eos_ids: list[int], pad_id: int):
    """The model's generation config as continuations() runs it, but for one draw more, one
    prefill forward over the whole prompt and one forward per new token."""
    config = deepcopy(model.generation_config)
    for setting in ("forced_eos_token_id", "max_time"):
        if getattr(config, setting, None) is not None:
            raise TargetError(f"the target's generation config sets {setting}, which ends "
                              "generation before its last token is fed: extract with "
                              "--capture forward")
    config.update(do_sample=False, max_new_tokens=max_new_tokens + 1, eos_token_id=eos_ids,
                  pad_token_id=pad_id, temperature=None, top_p=None, top_k=None,
                  use_cache=True, prefill_chunk_size=None)
    return config


@contextmanager
def _quiet_generate():
    """generate says once that a custom eos criterion replaces its own: meant here."""
    logger = logging.getLogger("transformers.generation.utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _per_prompt(prompts, generated, forwards, prompt_topk, step_topk, max_new_tokens,
                eos_ids, width) -> list[tuple[list[int], TokenStates]]:
    """Cut each row's answer at its first eos (or max_new_tokens) and gather its tokens'
    states: prompt from the prefill, answer token i from decoder forward i + 1."""
    offsets = [0]
    for p in prompts:
        offsets.append(offsets[-1] + len(p))
    results = []
    for b, (p, row) in enumerate(zip(prompts, generated.tolist(), strict=True)):
        answer = row[:max_new_tokens]
        cut = next((i + 1 for i, t in enumerate(answer) if t in eos_ids), len(answer))
        answer = answer[:cut]
        if len(forwards) < cut + 1:  # generate stopped before feeding this row's last token
            raise TargetError(f"generation stopped after {len(forwards) - 1} steps, before "
                              f"prompt {b}'s answer of {cut} tokens was fed")
        steps = range(1, cut + 1)
        lo, hi = offsets[b], offsets[b + 1]
        states = TokenStates(
            context=torch.cat([forwards[0][b, width - len(p):],
                               *(forwards[s][b] for s in steps)]),
            topk_ids=torch.cat([prompt_topk[0][lo:hi].cpu(), *(step_topk[s][0][b:b + 1]
                                                               for s in steps)]),
            topk_logits=torch.cat([prompt_topk[1][lo:hi].cpu(), *(step_topk[s][1][b:b + 1]
                                                                  for s in steps)]),
            lse=torch.cat([prompt_topk[2][lo:hi].cpu(), *(step_topk[s][2][b:b + 1]
                                                          for s in steps)]),
        )
        if states.context.shape[0] != len(p) + cut:  # one forward a token, or a bug here
            raise TargetError(f"prompt {b}: {states.context.shape[0]} states for "
                              f"{len(p) + cut} tokens")
        results.append((answer, states))
    return results
