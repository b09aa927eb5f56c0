"""`eval --online`: real greedy speculative decoding with the target and each drafter.

The loop (docs/reference.md §8): prefill the prompt, the target's argmax is the first token;
then per round the drafter drafts a block at the last committed token, the target verifies
it, the matching prefix plus the target's next token (the bonus) are committed, and the
target's states at the verified positions extend the drafter's context.

For correctness on any target, hybrid ones included (a recurrent linear-attention state
cannot be cropped after a partly rejected block), the target is recomputed over the whole
committed sequence plus the block every round, with no cache: O(L^2) per prompt, meant for
the tiny targets of the tests and for spot checks. A cached loop is a later optimisation.

Generation ends as extract's regeneration ends it: at the first end-of-turn token, after
max_new_tokens new tokens, or when the sequence reaches the store's max_length. A round's tau
is the tokens it commits: the accepted drafts and the target's bonus token, cut at that end,
so drafts past the end do not count and no bonus is counted when the end falls inside the
accepted drafts. That is exactly the offline tau of the same block (replay.tokens_left).
Every round drafts a full block, as serving engines do; z-lab's loop drafts as many slots as
tokens are left near max_new_tokens (their last blocks can differ from ours there).

Prompts are the stored samples' tokens before their first response token, so on a store
made with `extract --regenerate` the generated text equals the stored text and offline
`--mode replay` must give the same tau, prompt by prompt. Never writes the store.
"""

from dataclasses import dataclass, field

import torch

from dflash_train.blocks import first_anchor
from dflash_train.dtypes import torch_dtype
from dflash_train.evaluate.drafting import BlockDrafter
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.replay import CheckpointResults, EvalSample, EvalSettings, labels_for
from dflash_train.store_schema import StoreMeta, TargetInfo, target_differences


@dataclass
class StopRule:
    """When a generation is over."""

    eos_ids: list[int]
    """Tokens that end the turn (committed, then generation stops)."""
    max_new_tokens: int
    """New tokens after the prompt."""
    max_length: int
    """Total tokens (extract truncates stored samples here)."""

    def done(self, token: int, new_tokens: int, length: int) -> bool:
        return (token in self.eos_ids or new_tokens >= self.max_new_tokens
                or length >= self.max_length)


@dataclass
class Round:
    """One draft-and-verify round."""

    anchor: int
    tau: int
    """Tokens the round committed: accepted drafts, then the bonus, up to the end."""
    logp: torch.Tensor
    """[B, k] the drafter's per-slot top-k log-probs."""
    ids: torch.Tensor
    """[B, k] and their ids."""


@dataclass
class OnlineRun:
    """A prompt decoded live."""

    prompt_length: int
    tokens: list[int]
    """Prompt + generated tokens."""
    rounds: list[Round] = field(default_factory=list)


class TargetStates:
    """The target as the loop needs it: context features and argmax for a token sequence."""

    def __init__(self, target, layer_ids: list[int], hidden_dtype: str):
        self.target = target
        self.layer_ids = layer_ids
        self.dtype = torch_dtype(hidden_dtype)

    @torch.inference_mode()
    def __call__(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Features [1, T, n, H] (in the store's dtype, as offline sees them) and argmax [T]."""
        from dflash_train.target_model.capture import forward_states
        from dflash_train.target_model.verifier import verifier_topk

        ids = torch.tensor([tokens], device=self.target.device)
        context, final = forward_states(self.target.decoder, self.layer_ids, ids,
                                        torch.ones_like(ids))
        # The same chunked top-k that wrote the store's labels, so ties break the same way.
        top, _, _ = verifier_topk(final[0], self.target.lm_head, 1)
        return context.to(self.dtype).cpu(), top[:, 0].long().cpu()


def load_online_target(model: str, meta: StoreMeta, *, device: str) -> TargetStates:
    """Load --model (as extract loads it) and refuse a target other than the store's."""
    from dflash_train.target_model.errors import TargetError
    from dflash_train.target_model.loading import load_target

    try:
        target = load_target(model, device=device, dtype=torch_dtype(meta.hidden_dtype),
                             load_as="causal-lm")
    except TargetError as e:
        raise EvalError(str(e)) from e
    check_target(model, target.info, meta.target)
    return TargetStates(target, list(meta.context_layer_ids), meta.hidden_dtype)


EVAL_CHECKED = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "revision",
                "weights_sha256")
"""The target fields eval can know of --model, in the order a refusal lists them: not its
path (a copy is the same target), its config hash or a hub revision (eval takes no --revision)."""


def check_target(model: str, got: TargetInfo, want: TargetInfo) -> None:
    """EvalError naming each field where --model (`got`) is not the store's target, by the
    one same-target rule (store_schema.target_differences)."""
    from dflash_train.target_model.gguf import REVISION_PREFIX

    gguf = any(str(t.revision).startswith(REVISION_PREFIX) for t in (got, want))
    checked = [f for f in EVAL_CHECKED if f != "revision" or gguf]  # a GGUF's content hash
    differ = {f: (g, w) for f, g, w in target_differences(got, want)}
    wrong = [f"{f}: --model {differ[f][0]}, store {differ[f][1]}" for f in checked if f in differ]
    if wrong:
        raise EvalError(f"--model {model} is not the store's target "
                        f"({want.name_or_path}):\n  " + "\n  ".join(wrong))


@torch.no_grad()
def speculative_decode(target: TargetStates, drafter: BlockDrafter, prompt: list[int],
                       stop: StopRule, top_k: int) -> OnlineRun:
    """Greedy speculative decoding of one prompt; recomputes the target each round."""
    b = drafter.block_size
    tokens = list(prompt)
    features, top1 = target(tokens)
    cache = drafter.context_cache(features)  # positions 0 .. P-1
    tokens.append(int(top1[-1]))
    run = OnlineRun(len(prompt), tokens)
    new = 1
    done = stop.done(tokens[-1], new, len(tokens))
    while not done:
        anchor = len(tokens) - 1
        logp, ids = drafter.draft(cache, torch.tensor([[anchor]]),
                                  torch.tensor([[tokens[anchor]]]), top_k)
        draft = ids[0, 0, 1:, 0].tolist()
        features, top1 = target(tokens + draft)
        verify = top1[anchor : anchor + b].tolist()  # target's tokens for a+1 .. a+B
        accepted = 0
        while accepted < b - 1 and draft[accepted] == verify[accepted]:
            accepted += 1
        for token in draft[:accepted] + [verify[accepted]]:
            tokens.append(token)
            new += 1
            if stop.done(token, new, len(tokens)):
                done = True
                break
        run.rounds.append(Round(anchor, len(tokens) - 1 - anchor, logp[0, 0], ids[0, 0]))
        if not done:
            # The verified positions a .. a+accepted now have target states; the bonus
            # token (the next anchor) does not until the next round verifies it.
            drafter.extend(cache, features[:, anchor : anchor + accepted + 1])
    return run


def online_sample(s: EvalSample, run: OnlineRun) -> EvalSample:
    """The generated sequence as a sample whose labels are its own next tokens."""
    ids = torch.tensor(run.tokens, dtype=torch.long)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[run.prompt_length:] = True
    # Greedy decoding: the token at t+1 IS the target's argmax at t (teacher-forced labels).
    top1 = torch.cat([ids[1:], ids[-1:]])
    return EvalSample(s.part, s.index, s.source_row, ids, mask, torch.empty(0), top1)


def prompt_of(s: EvalSample) -> list[int] | None:
    """Tokens before the first response token; None when the sample has no response."""
    start = first_anchor(s.loss_mask)
    return None if start is None else s.input_ids[:start].tolist()


def evaluate_online(target: TargetStates, drafters: dict[str, BlockDrafter],
                    samples: list[EvalSample], settings: EvalSettings, stop: StopRule
                    ) -> tuple[dict[str, CheckpointResults], dict[tuple[int, int], list[int]]]:
    """Decode every sample's prompt live with each drafter; metrics as offline, and the
    generated tokens per sample key (they do not depend on the drafter)."""
    results = {n: CheckpointResults(n, d.block_size, settings, not d.walks)
               for n, d in drafters.items()}
    generated: dict[tuple[int, int], list[int]] = {}
    for s in samples:
        prompt = prompt_of(s)
        if prompt is None:
            continue
        for name, drafter in drafters.items():
            run = speculative_decode(target, drafter, prompt, stop,
                                     settings.top_k(drafter.config.vocab_size))
            generated.setdefault(s.key, run.tokens)
            if not run.rounds:
                continue
            live = online_sample(s, run)
            blocks = [(live, r.anchor) for r in run.rounds]
            labels, valid = labels_for(blocks, drafter.block_size)
            taus = results[name].add(blocks, torch.stack([r.logp for r in run.rounds]),
                                     torch.stack([r.ids for r in run.rounds]), labels, valid)
            verified = [r.tau for r in run.rounds]
            if taus != verified:
                raise EvalError(f"online {name}, sample {s.key}: verified taus {verified} "
                                f"disagree with the generated labels {taus} (internal error)")
    return results, generated
