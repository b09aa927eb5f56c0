"""Continuations from OpenAI-compatible servers (`extract --regenerate --server URL`).

Owns the HTTP side of regeneration: checking that each server serves the target, sending
prompts as token ids to /v1/completions (greedy, or sampled at the run's settings with a seed
per request from the run's seed and the source row), reading the completion's token ids back
verbatim (vLLM's `return_token_ids`; text is never re-tokenized: docs/reference.md §6), and
keeping a bounded number of requests in flight across the servers, naming the slow ones. The
transport (URLs, timeouts, every way an exchange fails) is server_http.py's. Never writes the
store; the target's forward still runs in extract itself.
"""

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath

from tqdm import tqdm

from dflash_train.extract.errors import ExtractError
from dflash_train.extract.server_http import (
    DEFAULT_TIMEOUT_S,
    ReplyError,
    check_timeout,
    http_json,
    server_url,
)
from dflash_train.json_fields import is_integer
from dflash_train.target_model.sampling import GREEDY, SamplingConfig, request_seed

MODELS_TIMEOUT_S = 30.0
"""Most seconds /v1/models may take (less when --server-timeout is less)."""
SLOW_REQUEST_S = 30.0
"""No answer from any server for this long (or a quarter of --server-timeout, if less) names
the oldest request in flight on stderr, so a silent server is never waited on without a
word."""


@dataclass(frozen=True)
class Server:
    """One server checked to serve the target."""

    url: str
    """Base URL, without a trailing /v1."""
    model: str
    """The served name requests must give as `model`."""
    max_model_len: int | None
    """Longest prompt + completion it accepts, when it reports one."""


def _names(name_or_path: str) -> set[str]:
    """Spellings of a model a server may report: as given, and its last path component (a
    server started on /models/Qwen3-8B serves what --model Qwen/Qwen3-8B names)."""
    name = name_or_path.rstrip("/")
    return {name, PurePosixPath(name).name}


def match_model(url: str, models: dict, targets: list[str], need_len: int) -> Server:
    """The card of /v1/models whose id or root names the target (compared by the spellings of
    `_names`), refused when its max_model_len cannot hold what extract will ask."""
    cards = models.get("data")
    if not isinstance(cards, list) or not all(isinstance(c, dict) for c in cards):
        raise ExtractError(f"--server {url}: /v1/models has no list of models ('data')")
    wanted = set().union(*(_names(t) for t in targets))
    for card in cards:
        served = {n for key in ("id", "root") if isinstance(card.get(key), str)
                  for n in _names(card[key])}
        if served & wanted and isinstance(card.get("id"), str):
            limit = card.get("max_model_len")
            limit = limit if is_integer(limit) else None
            if limit is not None and limit < need_len:
                raise ExtractError(
                    f"--server {url} serves {card['id']} with max_model_len {limit}, but a "
                    f"prompt and its completion need up to {need_len} tokens: restart it with "
                    f"--max-model-len {need_len} or more, or lower --max-length")
            return Server(url, card["id"], limit)
    ids = [c.get("id") for c in cards]
    raise ExtractError(f"--server {url} serves {ids or 'no model'}, not --model {targets[0]} "
                       "(compared by the served id and root, whole or by last path "
                       "component): start it on the target, or drop it")


def check_servers(urls: list[str], targets: list[str], need_len: int, timeout: float
                  ) -> list[Server]:
    """Every --server, asked for /v1/models and checked to serve the target; refused first.
    Every URL is checked to be one before any is contacted."""
    check_timeout(timeout)
    bases = [server_url(url) for url in urls]
    servers = []
    for url in bases:
        try:
            models = http_json(f"{url}/v1/models", None, min(MODELS_TIMEOUT_S, timeout))
        except ReplyError as e:
            raise ExtractError(f"--server {url}: {e}") from e
        servers.append(match_model(url, models, targets, need_len))
    return servers


def completion_request(model: str, prompt: list[int], max_tokens: int, eos_ids: list[int],
                       sampling: SamplingConfig, row: int) -> dict:
    """Stopping where the built-in path stops, token ids both ways: greedy, or sampled at
    `sampling`'s temperature, top-p and top-k (0: off, in vLLM too) with min-p off and
    source row `row`'s own seed (`request_seed`), so a rerun asks for the same draws."""
    request = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "top_p": 1.0, "n": 1, "stop_token_ids": eos_ids, "return_token_ids": True,
               "skip_special_tokens": False, "stream": False}
    if not sampling.greedy:
        request |= {"temperature": sampling.temperature, "top_p": sampling.top_p,
                    "top_k": sampling.top_k, "min_p": 0.0,
                    "seed": request_seed(sampling.seed, row)}
    return request


def read_completion(reply: dict, prompt: list[int], max_tokens: int, eos_ids: list[int],
                    vocab_size: int) -> list[int]:
    """The completion's token ids, cut after the first eos; ReplyError when they are missing,
    not ids of the target's vocabulary, longer than asked, or stop short of both an eos and
    the cap (the server stopped where the built-in decoding would not have)."""
    choices = reply.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise ReplyError("the reply has no single choice")
    choice = choices[0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise ReplyError("the reply carries no token ids ('token_ids'): the server must "
                         "support return_token_ids (vLLM >= 0.10.2)")
    bad = next((t for t in ids if type(t) is not int or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ReplyError(f"token id {bad!r} is not an id of the target's {vocab_size}-token "
                         "vocabulary")
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and echoed != prompt:
        raise ReplyError("the server read another prompt than the ids sent")
    cut = next((i + 1 for i, t in enumerate(ids) if t in eos_ids), None)
    if cut is not None:
        return ids[:cut]
    if len(ids) != max_tokens:
        raise ReplyError(f"{len(ids)} tokens, no eos and not the {max_tokens} asked "
                         f"(finish_reason {choice.get('finish_reason')!r})")
    return ids


OnDone = Callable[[int], None]
"""Called with the number of tokens of each completion as it arrives."""


def _stderr_note(line: str) -> None:
    tqdm.write(line, file=sys.stderr)  # above any progress bar, not through it


class _InFlight:
    """The requests sent and not yet answered. When none has been answered for `slow_s`,
    the oldest is named once (again only after the next answer): a busy server answering
    steadily is never named, a silent one always is."""

    def __init__(self, slow_s: float, timeout: float, note: Callable[[str], None]):
        self.slow_s, self.timeout, self.note = slow_s, timeout, note
        self.sent: dict[int, tuple[str, float]] = {}
        """row -> (server URL, when it was sent)."""
        self.last_answer = time.monotonic()
        self.named = False
        """Whether this stall (the time since the last answer) was named already."""
        self.lock = threading.Lock()

    def start(self, row: int, url: str) -> None:
        with self.lock:
            self.sent[row] = (url, time.monotonic())

    def end(self, row: int) -> None:
        with self.lock:
            self.sent.pop(row, None)
            self.last_answer, self.named = time.monotonic(), False

    def name_stall(self) -> None:
        now = time.monotonic()
        with self.lock:
            if self.named or not self.sent or now - self.last_answer < self.slow_s:
                return
            row, (url, sent) = min(self.sent.items(), key=lambda item: item[1][1])
            self.named, waiting = True, len(self.sent)
        self.note(f"waiting on --server {url} for row {row} ({now - sent:.0f} s so far, no "
                  f"answer to any of {waiting} request(s) in flight for "
                  f"{now - self.last_answer:.0f} s): a long generation, or a server gone "
                  f"silent; each request gives up after {self.timeout:g} s without an answer "
                  "(--server-timeout)")


@dataclass(frozen=True)
class Ask:
    """What every completion asks a server for, and what its reply is checked against."""

    max_new_tokens: int
    eos_ids: list[int]
    vocab_size: int
    """The target's: every id of a reply must lie below it."""
    sampling: SamplingConfig = GREEDY
    """Greedy, or how each request samples (completion_request)."""


def server_continuations(servers: list[Server], prompts: list[tuple[int, list[int]]],
                         ask: Ask, *, in_flight: int, timeout: float = DEFAULT_TIMEOUT_S,
                         on_done: OnDone | None = None,
                         note: Callable[[str], None] = _stderr_note) -> dict[int, list[int]]:
    """{row: new tokens} for each (source row, prompt ids), asked as `ask` says, prompt i
    sent to server i mod n, at most `in_flight` requests at a time, each given up after
    `timeout` seconds of silence. The first failure stops the rest and is raised as an
    ExtractError naming the row and the server; SLOW_REQUEST_S without any answer names the
    oldest request through `note`."""
    waiting = _InFlight(min(SLOW_REQUEST_S, timeout / 4), timeout, note)

    def one(i: int, row: int, prompt: list[int]) -> tuple[int, list[int]]:
        server = servers[i % len(servers)]
        cap = ask.max_new_tokens
        if server.max_model_len is not None:  # the stored sample stops at max_length anyway
            cap = min(cap, server.max_model_len - len(prompt))
        waiting.start(row, server.url)
        try:
            reply = http_json(f"{server.url}/v1/completions",
                              completion_request(server.model, prompt, cap, ask.eos_ids,
                                                 ask.sampling, row), timeout)
            new = read_completion(reply, prompt, cap, ask.eos_ids, ask.vocab_size)
        except ReplyError as e:
            raise ExtractError(f"row {row}: --server {server.url}: {e}; nothing of this row "
                               "was written (re-run to resume)") from e
        finally:
            waiting.end(row)
        if on_done is not None:
            on_done(len(new))
        return row, new

    return _on_daemon_threads(one, list(enumerate(prompts)), in_flight, waiting)


def _on_daemon_threads(one: Callable[[int, int, list[int]], tuple[int, list[int]]],
                       jobs: list[tuple[int, tuple[int, list[int]]]], threads: int,
                       waiting: _InFlight) -> dict[int, list[int]]:
    """{row: new tokens} of one(i, row, prompt) for each job (i, (row, prompt)), in job
    order, on at most `threads` threads; the first error stops the rest and is raised here.
    Each `waiting.slow_s` without a thread ending, `waiting` may name the oldest request."""
    # Daemon threads, not a ThreadPoolExecutor: after the first failure (or Ctrl-C) the
    # error is raised at once and the process may exit while other generations are still
    # in flight; an executor's threads are joined at exit, up to the timeout each.
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for job in jobs:
        todo.put(job)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    stop, ended = threading.Event(), threading.Semaphore(0)

    def worker() -> None:
        try:
            while not stop.is_set():
                try:
                    i, (row, prompt) = todo.get_nowait()
                except queue.Empty:
                    return
                row, new = one(i, row, prompt)
                results[row] = new
        except BaseException as e:  # raised in the caller's thread, below
            errors.append(e)
            stop.set()
        finally:
            ended.release()

    workers = [threading.Thread(target=worker, daemon=True, name=f"dflash-server-{n}")
               for n in range(max(1, min(threads, len(jobs))))]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            while not ended.acquire(timeout=waiting.slow_s):
                waiting.name_stall()
            if errors:
                break
    finally:
        stop.set()
    if errors:
        raise errors[0]
    return {row: results[row] for _, (row, _) in jobs}


AGREEMENT_FLOOR = 0.5
"""Least share of served answer tokens equal to the target forward's own top-1 at the token
before them (of sampled answers: among its stored top-k) that extract accepts. Greedy decoding
by the same weights agrees on every token in fp32 (tests/extract/test_server_vllm.py) and on
nearly all across dtypes and kernels (near-ties only); another model served under a name like
--model's agreed on 0.27 %."""
AGREEMENT_NOTE = 0.9
"""Below this share (and above the floor) a greedy extract ends with a note: the same weights
in another dtype or quantization, whose drift makes offline replay a poorer estimate. Sampled
answers get no note: a draw from the tail at temperature 1 is no drift."""
MIN_AGREEMENT_TOKENS = 64
"""Fewer answer tokens than this say too little to refuse a store on."""


def check_agreement(store, servers: list[Server], echo=None) -> None:
    """Refuse a store whose served answers the target itself would not have given (greedy:
    the top-1 share store info reports, store_schema.info.top1_agreement; sampled: the share
    among the forward's stored top-k, topk_agreement), naming the share and what to do; a
    merely low greedy share is noted through `echo`, when given."""
    from dflash_train.store_schema.info import top1_agreement, topk_agreement

    sampled = store.meta.sampling is not None
    agree, total = (topk_agreement if sampled else top1_agreement)(store)
    if total < MIN_AGREEMENT_TOKENS:
        return
    share = agree / total
    named = ", ".join(s.url for s in servers)
    said = (f"--server {named}: {agree:,} of {total:,} answer tokens ({share:.2%}) "
            + (f"lie among the target's own top-{store.meta.top_k}" if sampled
               else "equal the target's own top-1") + " at the token before them")
    if share < AGREEMENT_FLOOR:
        raise ExtractError(
            f"{said}, where the same weights agree on nearly all: the server generates with "
            f"another model than --model. {store.url} holds its answers (not the target's): "
            f"remove it, serve the target itself, and extract again")
    if share < AGREEMENT_NOTE and not sampled and echo is not None:
        echo(f"note: {said}: the server's weights, dtype or quantization differ from the "
             "target's; offline replay on this store is only an estimate of live decoding")
