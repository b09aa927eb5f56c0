"""Generation that keeps what the target computed on the way: the selected layers' states and
the verifier's top-k at every token of prompt + answer, so extract --regenerate needs no
second forward over the same tokens (it was most of extract's time: a full forward again).

Owns running `generate` with hooks. The answers are generate's own (the same call, the same
batches, the same keyed draw as generation.continuations), so the tokens are the ones the
plain path makes; only the stopping differs, which no row's tokens depend on (every GEMM row
and attention row of a batch is computed apart from the others):
- a row's last token must itself be fed once, for its states, so generate runs up to
  max_new_tokens + 1 and a row stops only after its eos was fed; the extra draw is dropped;
- generate's own eos stop would feed padding after an eos, and end the batch before the last
  eos is fed: it is turned off and `_EosFed` stops rows instead.
Where each value comes from: the prompt's states and top-k from the prefill (top-k through
verifier_topk, as the capture forward computes it); an answer token's states from the step
that fed it, its top-k from the raw logits that step handed the logits processors (the
logits its own successor was drawn from). Never writes a file.
"""

from copy import deepcopy
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from dflash_train.target_model.capture import hooked_layers
from dflash_train.target_model.errors import TargetError
from dflash_train.target_model.generation import OnStep, keyed_draw, left_padded, step_counter
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
        """The first n tokens' (causal: what a sequence cut after n tokens would give)."""
        return TokenStates(self.context[:n], self.topk_ids[:n], self.topk_logits[:n],
                           self.lse[:n])


class _EosFed(StoppingCriteria):
    """A row is done once an eos it generated has been fed back (it is no longer the last
    column)."""

    def __init__(self, width: int, eos_ids: list[int]):
        self.width = width
        self.eos = torch.tensor(eos_ids, dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        fed = input_ids[:, self.width:-1]
        return torch.isin(fed, self.eos.to(fed.device)).any(dim=-1)


class _TopkOfScores(LogitsProcessor):
    """Records the top-k and lse of the raw logits of every step, before any draw, on the
    host; hands them on unchanged."""

    def __init__(self, k: int):
        self.k = k
        self.steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps.append(tuple(t.cpu() for t in topk_of_logits(scores, self.k)))
        return scores


@torch.inference_mode()
def generate_with_states(target: Target, prompts: list[list[int]], *, layer_ids: list[int],
                         top_k: int, max_new_tokens: int, eos_ids: list[int], pad_id: int,
                         sampling: SamplingConfig = GREEDY,
                         sample_ids: list[int] | None = None,
                         on_step: OnStep | None = None
                         ) -> list[tuple[list[int], TokenStates]]:
    """The answers generation.continuations gives for `prompts`, each with the states of its
    prompt + answer tokens."""
    model, device = target.model, target.device
    input_ids, attention_mask, width = left_padded(prompts, pad_id)
    forwards: list[torch.Tensor] = []  # per decoder forward: [B, T, layers, H] on the host
    prompt_topk: list = []
    scores = _TopkOfScores(top_k)
    processors = LogitsProcessorList([scores])
    keyed = keyed_draw(sampling, sample_ids, prompts, width, device)
    if keyed is not None:
        processors.extend(keyed)
    config = deepcopy(model.generation_config)
    config.update(do_sample=False, max_new_tokens=max_new_tokens + 1, pad_token_id=pad_id,
                  temperature=None, top_p=None, top_k=None)
    # _EosFed stops rows (see the module docstring); a None here would be filled in again from
    # the model's own config, so generate's eos is an id no draw can return (one past the head)
    config.eos_token_id = target.lm_head.weight.shape[0]

    def keep(_decoder, _args, output) -> None:
        states = torch.stack([captured[k] for k in layer_ids], dim=2)
        if not forwards:  # the prefill: the prompt tokens' top-k, as the capture forward's
            final = output.last_hidden_state[attention_mask.to(device).bool()]
            prompt_topk.append(verifier_topk(final, target.lm_head, top_k))
        forwards.append(states.cpu())

    with hooked_layers(target.decoder.layers, layer_ids) as captured:
        handle = target.decoder.register_forward_hook(keep)
        try:
            out = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                generation_config=config, logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([_EosFed(width, eos_ids)]),
                streamer=step_counter(len(prompts), max_new_tokens, eos_ids, on_step))
        finally:
            handle.remove()
    return _per_prompt(prompts, out[:, width:].cpu(), forwards, prompt_topk[0], scores.steps,
                       max_new_tokens, eos_ids, width)


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
        results.append((answer, TokenStates(
            context=torch.cat([forwards[0][b, width - len(p):],
                               *(forwards[s][b] for s in steps)]),
            topk_ids=torch.cat([prompt_topk[0][lo:hi].cpu(), *(step_topk[s][0][b:b + 1]
                                                               for s in steps)]),
            topk_logits=torch.cat([prompt_topk[1][lo:hi].cpu(), *(step_topk[s][1][b:b + 1]
                                                                  for s in steps)]),
            lse=torch.cat([prompt_topk[2][lo:hi].cpu(), *(step_topk[s][2][b:b + 1]
                                                          for s in steps)]),
        )))
    return results
