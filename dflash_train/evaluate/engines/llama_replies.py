"""What llama-server answers, read and checked: every reply is untrusted input. Its
/completion JSON, its /metrics text and its per-step log lines are parsed here, and each value
is checked (type, range, agreement with the others) before the driver (llama_cpp.py) uses it;
anything wrong is an EvalError naming the checkpoint, the prompt and the field. This module
never asks the server anything, never starts one and never applies --online's stop rule.

What llama.cpp tells, per request (docs/design.md lists the source lines):
- the response: the generated token ids (`return_tokens`), why it stopped (`stop_type`), and
  `timings.draft_n` / `timings.draft_n_accepted`, the request's drafted and accepted totals;
- its log, with LLAMA_TRACE=1: one "accepted A/D draft tokens" line per verify step, the only
  per-step account it gives;
- /metrics, once per checkpoint (a fresh server each): `llamacpp:spec_decode_*` totals.
The log's steps must add up to the response's totals (EvalError otherwise); their sum over
every request is checked against /metrics (`counters_agree` in the report).
"""

import json
import re
from dataclasses import dataclass

from dflash_train.evaluate.engines.speed import checked_time
from dflash_train.evaluate.errors import EvalError

STEP = re.compile(r"\| task (\d+) \| accepted\s+(\d+)/\s*(\d+) draft tokens(.*)$")
"""server-context.cpp logs a verify step so (LLAMA_TRACE > 0); a suffix marks a restore."""
RELEASE = re.compile(r"\| task (\d+) \| stop processing:")
"""Logged when the slot is released, after the last step of the request."""
_STOP_TYPES = ("eos", "limit")
"""Why it may stop here: an end-of-generation token, n_predict (no stop words are sent)."""

Step = tuple[int, int]
"""One verify step: (accepted, drafted)."""


@dataclass
class Completion:
    """One /completion answer, checked."""

    tokens: list[int]
    """The generated ids."""
    stop_type: str
    draft_n: int
    draft_accepted: int
    decode_seconds: float
    """timings.predicted_ms: from its first generated token to its last (the prompt's
    processing, which makes the first, is timings.prompt_ms)."""


def _int(value, what: str, where: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise EvalError(f"{where}: {what} is {value!r}, not an integer >= {low}")
    return value


def parse_completion(raw: bytes, prompt_length: int, vocab: int, where: str) -> Completion:
    """llama-server's /completion answer; EvalError naming what is wrong in it."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise EvalError(f"{where}: the answer is not JSON ({e}): {raw[:200]!r}") from e
    if not isinstance(body, dict):
        raise EvalError(f"{where}: the answer is a {type(body).__name__}, not an object")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise EvalError(f"{where}: no generated token ids (`tokens` is {str(tokens)[:80]})")
    for t in tokens:
        if _int(t, "a generated token id", where) >= vocab:
            raise EvalError(f"{where}: generated token id {t} is outside the {vocab}-token "
                            "vocabulary")
    _check_prompt_length(body, prompt_length, where)
    stop = body.get("stop_type")
    if stop not in _STOP_TYPES:
        raise EvalError(f"{where}: stop_type {stop!r}, expected one of {_STOP_TYPES}")
    timings = body.get("timings")
    if not isinstance(timings, dict):
        raise EvalError(f"{where}: no `timings` object (it carries the draft counts)")
    if _int(timings.get("predicted_n"), "timings.predicted_n", where) != len(tokens):
        raise EvalError(f"{where}: timings.predicted_n {timings['predicted_n']} but "
                        f"{len(tokens)} token ids")
    # draft_n and draft_n_accepted are left out when nothing was drafted (server-common.cpp)
    return Completion(tokens, stop, _int(timings.get("draft_n", 0), "timings.draft_n", where),
                      _int(timings.get("draft_n_accepted", 0), "timings.draft_n_accepted",
                           where),
                      checked_time(timings.get("predicted_ms"),
                                   f"{where}: timings.predicted_ms") / 1000)


def _check_prompt_length(body: dict, prompt_length: int, where: str) -> None:
    """It read exactly our ids (no BOS of its own, nothing cached)."""
    evaluated = _int(body.get("tokens_evaluated"), "tokens_evaluated", where)
    if evaluated != prompt_length:
        raise EvalError(f"{where}: it evaluated {evaluated} prompt tokens, we sent "
                        f"{prompt_length} (a BOS of its own or a cached prefix?)")


_METRICS = {
    "llamacpp:spec_decode_num_drafts_total": "num_drafts",
    "llamacpp:spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "llamacpp:spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
}
_PER_POS = re.compile(
    r'^llamacpp:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\}$')


def parse_metrics(text: str, where: str) -> dict:
    """The spec-decode totals of llama-server's Prometheus text, in vLLM's names;
    EvalError when one is missing or not a number."""
    out: dict = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            raise EvalError(f"{where}: /metrics line {line[:120]!r} has no number") from None
        if name in _METRICS:
            out[_METRICS[name]] = number
        elif (m := _PER_POS.match(name)) is not None:
            per_pos[int(m.group(1))] = number
    missing = [n for n in _METRICS if _METRICS[n] not in out]
    if missing:
        raise EvalError(f"{where}: /metrics has no {', '.join(missing)} (was it started "
                        "with --metrics and a drafter?)")
    if sorted(per_pos) != list(range(len(per_pos))):
        raise EvalError(f"{where}: /metrics per-position counts at positions "
                        f"{sorted(per_pos)}, not 0..{len(per_pos) - 1}")
    out["accepted_per_pos"] = [per_pos[i] for i in range(len(per_pos))]
    return out


def parse_steps(log: str, where: str) -> tuple[list[Step], bool]:
    """The verify steps the log segment `log` records for the request it ends, and whether
    it reached that request's end (the slot's release)."""
    steps: dict[int, list[Step]] = {}
    for line in log.splitlines():
        if (m := STEP.search(line)) is not None:
            if m.group(4).strip():
                raise EvalError(f"{where}: llama-server restored a checkpoint after a partly "
                                f"rejected draft ({line.strip()[-80:]}): a target whose cache "
                                "cannot drop rejected tokens (recurrent or hybrid); its log "
                                "then does not say what each step committed")
            task, accepted, drafted = (int(g) for g in m.groups()[:3])
            steps.setdefault(task, []).append((accepted, drafted))
        elif (m := RELEASE.search(line)) is not None:
            return steps.get(int(m.group(1)), []), True
    return [], False


def check_steps(steps: list[Step], done: Completion, block_size: int, where: str) -> None:
    """The log's steps are whole drafts of the drafter's block and add up to the answer's
    totals."""
    for i, (accepted, drafted) in enumerate(steps):
        if not 0 < drafted <= block_size - 1 or accepted > drafted:
            raise EvalError(f"{where}: step {i} accepted {accepted} of {drafted} drafts "
                            f"(block size {block_size})")
    drafted, accepted = sum(d for _, d in steps), sum(a for a, _ in steps)
    if (drafted, accepted) != (done.draft_n, done.draft_accepted):
        raise EvalError(f"{where}: its log's {len(steps)} steps drafted {drafted} and "
                        f"accepted {accepted}, its answer says {done.draft_n} and "
                        f"{done.draft_accepted}")


def printed_equal(printed: float | None, exact: int) -> bool:
    """Whether a Prometheus value llama-server printed equals `exact`: it streams doubles with
    C++'s default 6 significant digits (server-task.cpp), so 1234567 reads 1.23457e+06."""
    return printed is not None and float(f"{exact:.6g}") == printed


def metrics_agree(metrics: dict, steps: list[Step], block_size: int) -> bool:
    """Every step of every request (past --online's stop too) against /metrics."""
    per_pos = [sum(a > k for a, _ in steps) for k in range(block_size - 1)]
    printed = metrics.get("accepted_per_pos") or []
    return (printed_equal(metrics.get("num_drafts"), len(steps))
            and printed_equal(metrics.get("num_draft_tokens"), sum(d for _, d in steps))
            and printed_equal(metrics.get("num_accepted_tokens"), sum(a for a, _ in steps))
            and len(printed) == len(per_pos)
            and all(printed_equal(p, n) for p, n in zip(printed, per_pos, strict=True)))
