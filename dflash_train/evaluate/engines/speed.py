"""What a drafter buys in a serving engine: the engine decodes the same prompts with the drafter
and without it, the two runs taking turns (prompt by prompt, or wave by wave, the order
flipped each turn, so the machine's noise falls on both), and each request is timed by the
engine itself from its first generated token to its last: decode only, the prefill (which
makes the first token) left out.

Per run, pooled over its prompts: decode tokens (generated - 1), decode seconds, tokens/s and
ms per token; with the drafter also its rounds (verify steps: one draft and one verify each)
and ms per round. The ratio of tokens/s is the speedup. A round costs t_round, a step without
the drafter t_step, and a round commits tau tokens, so the drafter's tokens/s over the plain
one's is tau * t_step / t_round: it wins exactly when tau > t_round / t_step, the
break-even tau reported (measured from the two runs' own timings, not estimated).

This module only does arithmetic on what engines measured; it never runs one.
"""

import math
import statistics
from dataclasses import dataclass

from dflash_train.evaluate.errors import EvalError
from dflash_train.json_fields import is_number


@dataclass
class TimedDecode:
    """One prompt's generation as the engine timed it."""

    generated: list[int]
    """The token ids it generated (the first is the prefill's)."""
    seconds: float
    """From its first generated token to its last, by the engine's clock."""
    rounds: int = 0
    """Verify steps in that time (0 without a drafter)."""

    @property
    def tokens(self) -> int:
        """Tokens decoded in `seconds`: all but the prefill's."""
        return max(len(self.generated) - 1, 0)


def checked_time(value, what: str) -> float:
    """A time an engine reports, checked: a finite number >= 0 (EvalError naming `what`)."""
    if not is_number(value) or not math.isfinite(value) or value < 0:
        raise EvalError(f"{what} is {value!r}, not a finite time >= 0")
    return float(value)


def in_turn(runs: list, turn: int) -> list:
    """The order the runs take on turn `turn`: flipped every turn, so neither always runs
    first (on a machine the other just warmed, or left busy)."""
    return runs if turn % 2 == 0 else runs[::-1]


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if tokens and seconds > 0 else None


def _side(decodes: list[TimedDecode]) -> dict:
    """One run's decode figures, pooled over its prompts (total tokens over total time)."""
    tokens = sum(d.tokens for d in decodes)
    seconds = sum(d.seconds for d in decodes)
    per_token = [1000 * d.seconds / d.tokens for d in decodes if d.tokens and d.seconds > 0]
    rate = _rate(tokens, seconds)
    return {"decode_tokens": tokens, "decode_seconds": seconds, "tokens_per_s": rate,
            "ms_per_token": None if rate is None else 1000 / rate,
            "ms_per_token_per_prompt": _spread(per_token)}


def speed_summary(with_drafter: list[TimedDecode], without: list[TimedDecode], *,
                  timing: str, concurrency: str) -> dict:
    """The `speed` block of a served summary: the two runs of the same prompts (in the same
    order), their ratio and the break-even tau. `timing` says which clock the engine timed
    each request with, `concurrency` how many requests it decoded at once."""
    drafted, plain = _side(with_drafter), _side(without)
    rounds = sum(d.rounds for d in with_drafter)
    drafted |= {"rounds": rounds,
                "tokens_per_round": drafted["decode_tokens"] / rounds if rounds else None,
                "ms_per_round": 1000 * drafted["decode_seconds"] / rounds if rounds else None}
    pairs = [(_rate(a.tokens, a.seconds), _rate(b.tokens, b.seconds))
             for a, b in zip(with_drafter, without, strict=True)]
    both = drafted["tokens_per_s"] is not None and plain["tokens_per_s"] is not None
    break_even = (drafted["ms_per_round"] / plain["ms_per_token"]
                  if drafted["ms_per_round"] is not None and plain["ms_per_token"] is not None
                  else None)
    return {
        "timing": timing, "concurrency": concurrency, "prompts": len(with_drafter),
        "same_text": sum(a.generated == b.generated
                         for a, b in zip(with_drafter, without, strict=True)),
        "with_drafter": drafted, "without_drafter": plain,
        "speedup": drafted["tokens_per_s"] / plain["tokens_per_s"] if both else None,
        "speedup_per_prompt": _spread([a / b for a, b in pairs if a and b]),
        "break_even_tau": break_even,
    }
