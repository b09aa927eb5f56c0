"""`eval --online`: real speculative decoding with the target and each drafter.

The loop (docs/reference.md §8): prefill the prompt, the target's choice is the first token;
then per round the drafter drafts a block at the last committed token, a proposal is made of
that one pass (the chain of its drafts, or for a `--tree-budget` the DDTree grown from it by
evaluate/tree.py, the code offline replay grows it with), the target verifies the proposal,
the deepest path that matches the target's choices is committed with the target's next
token (the bonus), and the target's states at the committed positions before the bonus
extend the drafter's context.

The target's choice (`TargetChoice`) is its argmax on a greedy store, and on a sampled one
(StoreMeta.sampling) its keyed draw under the store's settings and seed: sample-and-match
(§8a), drafts staying the drafter's argmax. The draw is keyed as extract keyed the stored
answer: by the prompt's source row and the drawn token's absolute position, so the text
generated live is the stored text and the rounds are offline replay's, as at T = 0.

Two verifiers run that loop:
- `CachedVerifier` (the default): the target keeps its cache across rounds and verifies a
  whole proposal in one forward (target_model/cached.py: a tree attention mask over the
  cache; hybrid layers' recurrent states snapshotted, stepped node by node on a tree and
  brought to the committed path).
- `RecomputeVerifier` (`--no-cache`, and the reference the cached loop is tested against):
  no cache at all; the target is recomputed over the committed sequence plus the branch of
  the proposal it checks, every round (one forward for a chain, one per branch the accepted
  path leaves for a tree): O(L^2) per prompt, exact on any target.

Generation ends as extract's regeneration ends it: at the first end-of-turn token, after
max_new_tokens new tokens, or when the sequence reaches the store's max_length. A round's tau
is the tokens it commits: the accepted drafts and the target's bonus token, cut at that end,
so drafts past the end do not count and no bonus is counted when the end falls inside the
accepted drafts. That is exactly the offline tau of the same block (samples.tokens_left).
Every round drafts a full block, as serving engines do; z-lab's loop drafts as many slots as
tokens are left near max_new_tokens (their last blocks can differ from ours there).

Prompts are the stored samples' tokens before their first response token, so on a store
made with `extract --regenerate` (greedy or sampled) the generated text equals the stored
text and offline `--mode replay` must give the same tau, prompt by prompt, for the chain and
for each tree budget. Never writes the store.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dflash_train.blocks import first_anchor
from dflash_train.dtypes import torch_dtype
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.drafting import BlockDrafter, Draft
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.results import CheckpointResults
from dflash_train.evaluate.samples import EvalSample, labels_for
from dflash_train.evaluate.tree import (
    DraftTree,
    best_branch,
    chain_tree,
    grow_tree,
    path_tokens,
)
from dflash_train.store_schema import StoreMeta, TargetInfo, target_differences
from dflash_train.target_model.sampling import GREEDY, SamplingConfig, perturbed_logits


@dataclass
class StopRule:
    """When a generation is over."""

    eos_ids: list[int]
    """Tokens that end the turn (committed, then generation stops)."""
    max_new_tokens: int
    """New tokens after the prompt."""
    max_length: int
    """Total tokens (extract truncates stored samples here)."""

    def new_tokens_cap(self, prompt_length: int) -> int:
        """New tokens a prompt of this length may generate: the cap, never past max_length
        (at least 1)."""
        return max(min(self.max_new_tokens, self.max_length - prompt_length), 1)

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
    tree: DraftTree
    """What was verified: the chain of drafts, or the DDTree of the decode's budget."""


@dataclass
class LiveDecode:
    """A prompt decoded live."""

    prompt_length: int
    tokens: list[int]
    """Prompt + generated tokens."""
    tree_budget: int | None = None
    """The DDTree node budget of every round; None: chains."""
    rounds: list[Round] = field(default_factory=list)


@dataclass(frozen=True)
class TargetChoice:
    """How the target chooses its next token on one prompt: its argmax (greedy), or its keyed
    draw under `sampling`, keyed by the prompt's `sample_id` (its source row, as extract keyed
    the stored answer) and the absolute position of the token drawn."""

    sampling: SamplingConfig = GREEDY
    sample_id: int = 0

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def draw(self, logits: torch.Tensor, positions) -> list[int]:
        """The draws of logits rows [N, V] for tokens at `positions` [N] (T > 0 only)."""
        ids = [self.sample_id] * len(positions)
        return perturbed_logits(logits, self.sampling, ids, list(positions)).argmax(-1).tolist()

    def pick(self, verified, node: int, position: int) -> int:
        """The choice after `node` of a cached forward (target_model.cached.Verified), the
        token drawn sitting at `position`. Greedy: its top-1, the head on that row only."""
        if self.greedy:
            return verified.top1(node)
        return self.draw(verified.logits(node)[None], [position])[0]


class TargetStates:
    """The target as the loop needs it: context features and argmax for a token sequence."""

    def __init__(self, target, layer_ids: list[int], hidden_dtype: str):
        self.target = target
        self.layer_ids = layer_ids
        self.dtype = torch_dtype(hidden_dtype)

    @torch.inference_mode()
    def states(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Features [1, T, n, H] (in the store's dtype, as offline sees them, on the host)
        and the final-normed states [1, T, H] the head reads (on the target's device)."""
        from dflash_train.target_model.capture import forward_states

        ids = torch.tensor([tokens], device=self.target.device)
        context, final = forward_states(self.target.decoder, self.layer_ids, ids,
                                        torch.ones_like(ids))
        return context.to(self.dtype).cpu(), final

    @torch.inference_mode()
    def __call__(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Features [1, T, n, H] and argmax [T]."""
        from dflash_train.target_model.verifier import verifier_topk

        context, final = self.states(tokens)
        # The same chunked top-k that wrote the store's labels, so ties break the same way.
        top, _, _ = verifier_topk(final[0], self.target.lm_head, 1)
        return context, top[:, 0].long().cpu()

    @torch.inference_mode()
    def drawn(self, tokens: list[int], start: int, choice: TargetChoice
              ) -> tuple[torch.Tensor, list[int]]:
        """Features [1, T, n, H] and the target's draws (T > 0) after positions start ..
        T-1: the head on those rows only."""
        from dflash_train.target_model.verifier import head_logits

        context, final = self.states(tokens)
        logits = head_logits(final[0, start:], self.target.lm_head)
        return context, choice.draw(logits, range(start + 1, len(tokens) + 1))


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


def store_sampling(meta: StoreMeta) -> SamplingConfig:
    """How the store's answers were drawn (greedy unless it records sampling settings): the
    live loop's target chooses the same way, with the same seed."""
    from dflash_train.store_schema import StoreError
    from dflash_train.target_model.errors import TargetError

    try:
        recorded = meta.sampling
        return GREEDY if recorded is None else SamplingConfig(**recorded)
    except (StoreError, TargetError) as e:
        raise EvalError(f"the store's sampling settings cannot be used: {e}") from e


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


@dataclass
class AcceptedPath:
    """A verified proposal: the path the target accepted of it, and its bonus."""

    path: list[int]
    """Accepted nodes, root excluded, in depth order."""
    bonus: int
    """The target's next token after the last accepted node."""
    features: torch.Tensor
    """[1, 1 + len(path), n, H]: the target's states at the root and the accepted nodes."""


def live_accepted_path(tree: DraftTree, next_token: Callable[[int, list[int]], int]
                       ) -> tuple[list[int], int]:
    """(accepted nodes, bonus): from the root, follow the child whose token the target chose
    (`next_token(node, path)`: its greedy token after `node`, reached by `path`). The live
    counterpart of tree.accepted_path, which follows stored labels instead of asking."""
    path: list[int] = []
    node = 0
    while True:
        want = next_token(node, path)
        child = tree.children[node].get(want)
        if child is None:
            return path, want
        path.append(child)
        node = child


class CachedVerifier:
    """The target with its cache: a whole proposal verified in one forward. The states it
    hands the drafter stay on the target's device (in the store's dtype, as offline reads
    them): on one GPU they never cross to the host."""

    def __init__(self, target: TargetStates):
        from dflash_train.target_model.cached import CachedTarget

        self.dtype = target.dtype
        self.target = CachedTarget(target.target, target.layer_ids)

    def start(self, prompt: list[int], choice: TargetChoice = TargetChoice()
              ) -> tuple[torch.Tensor, int]:
        out = self.target.prefill(prompt)
        return out.features.to(self.dtype), choice.pick(out, -1, len(prompt))

    def verify(self, tokens: list[int], tree: DraftTree,
               choice: TargetChoice = TargetChoice()) -> AcceptedPath:
        pending = self.target.verify([tokens[-1], *tree.tokens[1:]], tree.parents)
        root = len(tokens) - 1
        # a node reached by `path` sits at root + len(path): the token after it at one more
        path, bonus = live_accepted_path(
            tree, lambda node, path: choice.pick(pending, node, root + len(path) + 1))
        kept = [0, *path]
        pending.keep(kept)
        return AcceptedPath(path, bonus, pending.features[:, kept].to(self.dtype))


class RecomputeVerifier:
    """No cache: the committed sequence plus the branch being checked is recomputed each time
    the accepted path leaves what was last forwarded (a chain: once a round)."""

    def __init__(self, target: TargetStates):
        self.target = target

    def _chosen(self, tokens: list[int], start: int, choice: TargetChoice
                ) -> tuple[torch.Tensor, list[int]]:
        """Features [1, T, n, H] and the target's choices after positions start .. T-1."""
        if choice.greedy:
            features, top1 = self.target(tokens)
            return features, top1[start:].tolist()
        return self.target.drawn(tokens, start, choice)

    def start(self, prompt: list[int], choice: TargetChoice = TargetChoice()
              ) -> tuple[torch.Tensor, int]:
        features, chosen = self._chosen(prompt, len(prompt) - 1, choice)
        return features, chosen[0]

    def verify(self, tokens: list[int], tree: DraftTree,
               choice: TargetChoice = TargetChoice()) -> AcceptedPath:
        root = len(tokens) - 1
        branch: list[int] | None = None
        states: tuple[torch.Tensor, list[int]] | None = None  # features, choices from root

        def next_token(_node: int, path: list[int]) -> int:
            nonlocal branch, states
            if branch is None or path != branch[: len(path)]:
                branch = best_branch(tree, path)
                states = self._chosen(tokens + path_tokens(tree, branch), root, choice)
            return states[1][len(path)]

        path, bonus = live_accepted_path(tree, next_token)
        return AcceptedPath(path, bonus, states[0][:, root : root + len(path) + 1])


def propose(drafted: Draft, budget: int | None) -> DraftTree:
    """The one block's proposal: its chain of drafts, or the DDTree of `budget` nodes."""
    if budget is None:
        return chain_tree(drafted.ids[0, 0, 1:, 0].tolist())
    return grow_tree(drafted.tree_candidates(0, 0), budget)


@torch.no_grad()
def speculative_decode(verifier, drafter: BlockDrafter, prompt: list[int], stop: StopRule,
                       top_k: int, tree_budget: int | None = None,
                       choice: TargetChoice = TargetChoice()) -> LiveDecode:
    """Speculative decoding of one prompt with chains, or DDTrees of `tree_budget` nodes,
    committing the target's `choice` (greedy, or sample-and-match); `verifier` is a
    CachedVerifier or a RecomputeVerifier."""
    tokens = list(prompt)
    features, first = verifier.start(tokens, choice)
    cache = drafter.context_cache(features)  # positions 0 .. P-1
    tokens.append(first)
    decode = LiveDecode(len(prompt), tokens, tree_budget)
    new = 1
    done = stop.done(tokens[-1], new, len(tokens))
    while not done:
        anchor = len(tokens) - 1
        drafted = drafter.draft(cache, torch.tensor([[anchor]]),
                                torch.tensor([[tokens[anchor]]]), top_k,
                                transitions=tree_budget is not None)
        tree = propose(drafted, tree_budget)
        accepted = verifier.verify(tokens, tree, choice)
        for token in [*path_tokens(tree, accepted.path), accepted.bonus]:
            tokens.append(token)
            new += 1
            if stop.done(token, new, len(tokens)):
                done = True
                break
        decode.rounds.append(Round(anchor, len(tokens) - 1 - anchor, drafted.logp[0, 0],
                                   drafted.ids[0, 0], tree))
        if not done:
            # The verified positions a .. a+accepted now have target states; the bonus
            # token (the next anchor) does not until the next round verifies it.
            drafter.extend(cache, accepted.features)
    return decode


def online_sample(s: EvalSample, decode: LiveDecode) -> EvalSample:
    """The generated sequence as a sample whose labels are its own next tokens."""
    ids = torch.tensor(decode.tokens, dtype=torch.long)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[decode.prompt_length:] = True
    # The token at t+1 IS the target's choice at t, its argmax or its draw (teacher-forced).
    top1 = torch.cat([ids[1:], ids[-1:]])
    return EvalSample(s.part, s.index, s.source_row, ids, mask, torch.empty(0), top1)


def prompt_of(s: EvalSample) -> list[int] | None:
    """Tokens before the first response token; None when the sample has no response."""
    start = first_anchor(s.loss_mask)
    return None if start is None else s.input_ids[:start].tolist()


def evaluate_online(target: TargetStates, drafters: dict[str, BlockDrafter],
                    samples: list[EvalSample], settings: EvalSettings, stop: StopRule,
                    cached: bool = True, sampling: SamplingConfig = GREEDY
                    ) -> tuple[dict[str, CheckpointResults], dict[tuple[int, int], list[int]]]:
    """Decode every sample's prompt live with each drafter, with chains and with a DDTree of
    each budget, the target choosing as `sampling` says (each prompt keyed by its source
    row); metrics as offline, and the generated tokens per sample key (they do not depend
    on the drafter)."""
    verifier = CachedVerifier(target) if cached else RecomputeVerifier(target)
    results = {n: CheckpointResults(n, d.block_size, settings) for n, d in drafters.items()}
    generated: dict[tuple[int, int], list[int]] = {}
    for s in samples:
        prompt = prompt_of(s)
        if prompt is None:
            continue
        choice = TargetChoice(sampling, s.source_row)
        for name, drafter in drafters.items():
            top_k = settings.top_k(drafter.config.vocab_size)
            for budget in results[name].walks:
                decode = speculative_decode(verifier, drafter, prompt, stop, top_k, budget,
                                            choice)
                # Every walk commits the target's own choices; in reduced precision a
                # near-tie may still break another way under another verify shape, which the
                # per-walk round check against offline replay then shows.
                generated.setdefault(s.key, decode.tokens)
                _score(results[name], s, decode, drafter.block_size)
    return results, generated


def _score(results: CheckpointResults, s: EvalSample, decode: LiveDecode, block_size: int
           ) -> None:
    """Add a live decode's rounds to `results`, scored on the generated text's labels as
    offline scores them; an internal error when that disagrees with what the target verified."""
    if not decode.rounds:
        return
    live = online_sample(s, decode)
    blocks = [(live, r.anchor) for r in decode.rounds]
    labels, valid = labels_for(blocks, block_size)
    drafts = (torch.stack([r.ids for r in decode.rounds]) if decode.tree_budget is None
              else [r.tree for r in decode.rounds])
    taus = results.add(decode.tree_budget, blocks, drafts, labels, valid)
    verified = [r.tau for r in decode.rounds]
    if taus != verified:
        what = "chain" if decode.tree_budget is None else f"tree @{decode.tree_budget}"
        raise EvalError(f"online {results.name} ({what}), sample {s.key}: verified taus "
                        f"{verified} disagree with the generated labels {taus} (internal error)")
