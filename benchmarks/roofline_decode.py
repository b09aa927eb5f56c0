"""The roofline's two decoding stages, at SmolLM2's shape, on the CPU.

  offline replay     `dflash eval`'s default replay walk (evaluate/replay.py's walk_replay,
                     through evaluate.drafting.BlockDrafter): the drafter's keys/values over
                     a batch of stored contexts once, then forward after forward drafting one
                     block per sequence at advancing anchors, top-k per slot; eval's CPU dtype
                     (float32); FLOPs counted as run; least traffic the drafter's weights once
                     a forward, the context once and the drafts.
  cached live round  `eval --online`'s loop (evaluate.online.speculative_decode with the
                     cached verifier): draft a block at the last token, verify it in one
                     target forward over the cache, keep the accepted path, extend the
                     drafter's cache. A random drafter against a random target accepts
                     (almost) nothing: a round's work with the fewest tokens to show for it.
                     Seconds per round: the fastest of three decodes of 2R rounds less the
                     fastest of three of R, over R (the prefill cancels). FLOPs: the drafter's
                     counted as run, the target's by formula (its forward runs under
                     inference_mode, which dispatch modes do not see) at the rounds' mean
                     cache length; least traffic both models' weights once a round.
The roofline module builds the models and puts these beside its other stages.
"""

import time

import torch

from benchmarks.roofline_parts import CountedFlops, Size, Stage, random_target


def _weights(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in (*module.parameters(), *module.buffers()))


def _drafter_weights(drafter) -> int:
    """Bytes a draft reads whole: the drafter's weights but the target's embedding (read by
    rows) and, when a draft vocabulary is set, the target's full head (not read)."""
    model = drafter.model
    skipped = {"target_embed_tokens"} | ({"target_lm_head"} if model.config.draft_vocab_size
                                         else set())
    return _weights(model) - sum(b.nbytes for n, b in model.named_buffers() if n in skipped)


def offline_replay(size: Size, drafter) -> Stage:
    """eval's default replay walk over one batch of `replay_sequences` stored contexts: the
    drafter's keys/values once, then `replay_steps` forwards of one block per sequence at
    advancing anchors (evaluate/replay.py's walk_replay), top-k per slot."""
    from dflash_train.evaluate.config import EvalSettings

    gen = torch.Generator().manual_seed(0)
    n, length, steps = size.replay_sequences, size.replay_length, size.replay_steps
    layers, hidden = len(drafter.config.target_layer_ids), drafter.config.hidden_size
    context = torch.randn(n, length, layers, hidden, generator=gen)
    anchors = torch.linspace(length // 2, length - 1, steps).long().expand(n, steps)
    tokens = torch.randint(0, drafter.config.vocab_size, (n, steps), generator=gen)
    top_k = EvalSettings().top_k(drafter.config.vocab_size)

    def replay():
        cache = drafter.context_cache(context)
        for step in range(steps):
            drafter.draft(cache, anchors[:, step:step + 1], tokens[:, step:step + 1], top_k)

    replay()  # warms kernels up
    start = time.perf_counter()
    replay()
    seconds = time.perf_counter() - start
    with CountedFlops() as counted:
        replay()
    drafts = n * steps * drafter.block_size * top_k * (4 + 8)  # fp32 log-probs, int64 ids
    return Stage("offline replay", f"{n} x {length} tokens, a walk of {steps} blocks each, "
                 f"top-{top_k}", sum(counted.by_dtype.values()),
                 steps * _drafter_weights(drafter) + context.nbytes + drafts, seconds,
                 torch.float32)


def _decode(target, drafter, prompt: list[int], rounds: int):
    """(the fastest of three timed decodes committing rounds + 1 tokens, the drafter's
    FLOPs counted on a fourth (the counter's dispatch costs time), the decode)."""
    from dflash_train.evaluate.config import EvalSettings
    from dflash_train.evaluate.online import CachedVerifier, StopRule, speculative_decode

    vocab = target.target.lm_head.weight.shape[0]
    stop = StopRule(eos_ids=[vocab], max_new_tokens=rounds + 1, max_length=10**6)
    top_k = EvalSettings().top_k(drafter.config.vocab_size)  # what eval --online drafts
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        decode = speculative_decode(CachedVerifier(target), drafter, prompt, stop, top_k)
        seconds.append(time.perf_counter() - start)
    with CountedFlops() as counted:
        speculative_decode(CachedVerifier(target), drafter, prompt, stop, top_k)
    return min(seconds), sum(counted.by_dtype.values()), decode


def verify_flops(model, block: int, cached: float) -> float:
    """FLOPs of one cached verify: `block` tokens through every layer of a Llama-shaped
    `model`, their attention over the `cached` tokens before and the block itself (as
    SDPA computes it under the verify's mask), then the head on the one node a rejected
    draft leaves; 2 FLOPs a multiply-add."""
    config = model.config
    decoder = sum(p.numel() for n, p in model.model.named_parameters()
                  if "norm" not in n and "embed" not in n)
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    return block * (2 * decoder + attention * (cached + block)) + 2 * model.lm_head.weight.numel()


def live_round(size: Size, drafter) -> Stage:
    """One round of the cached live loop after a `live_prompt`-token prompt, its target
    SmolLM2's shape with random weights."""
    from dflash_train.evaluate.online import TargetStates
    from dflash_train.target_model.loading import Target

    model, shape, layer_ids = random_target(size)
    target = TargetStates(Target(model=model, decoder=model.model, lm_head=model.lm_head,
                                 info=None, kernels=""), layer_ids, "float32")
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape["vocab_size"], (size.live_prompt,), generator=gen).tolist()
    _decode(target, drafter, prompt, 2)  # warms kernels up
    short = _decode(target, drafter, prompt, size.live_rounds)
    long = _decode(target, drafter, prompt, 2 * size.live_rounds)
    extra = long[2].rounds[len(short[2].rounds):]
    # a round's anchor is the cache's length before its verify (the anchor token leads the block)
    cached = sum(r.anchor for r in extra) / len(extra)
    flops = (verify_flops(model, drafter.block_size, cached)
             + (long[1] - short[1]) / len(extra))
    traffic = _weights(model) + _drafter_weights(drafter)
    return Stage("cached live round", f"1 block of {drafter.block_size} after a "
                 f"{size.live_prompt}-token prompt", flops, traffic,
                 (long[0] - short[0]) / len(extra), model.dtype)
