"""Greedy continuations from OpenAI-compatible servers (`extract --regenerate --server URL`).

Owns the HTTP side of regeneration: checking that each server serves the target, sending
prompts as token ids to /v1/completions, reading the completion's token ids back verbatim
(vLLM's `return_token_ids`; text is never re-tokenized: docs/reference.md §6), and keeping a
bounded number of requests in flight across the servers. Standard library HTTP only. Never
writes the store; the target's forward still runs in extract itself.
"""

import json
import queue
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath

from dflash_train.extract.errors import ExtractError

MODELS_TIMEOUT_S = 30.0
COMPLETION_TIMEOUT_S = 3600.0
"""A long generation on a busy server may take many minutes; a dead one is still caught."""


@dataclass(frozen=True)
class Server:
    """One server checked to serve the target."""

    url: str
    """Base URL, without a trailing /v1."""
    model: str
    """The served name requests must give as `model`."""
    max_model_len: int | None
    """Longest prompt + completion it accepts, when it reports one."""


class ReplyError(Exception):
    """A reply that is not a greedy continuation we can store; the message says why."""


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _http_json(url: str, body: dict | None, timeout: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode(errors="replace").replace("\n", " ")
        raise ReplyError(f"HTTP {e.code} from {url}: {detail}") from e
    except (urllib.error.URLError, OSError) as e:
        raise ReplyError(f"cannot reach {url} ({getattr(e, 'reason', e)})") from e
    try:
        reply = json.loads(raw)
    except ValueError as e:
        raise ReplyError(f"{url} answered with something that is not JSON ({e})") from e
    if not isinstance(reply, dict):
        raise ReplyError(f"{url} answered with a JSON {type(reply).__name__}, not an object")
    return reply


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
            limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
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


def check_servers(urls: list[str], targets: list[str], need_len: int) -> list[Server]:
    """Every --server, asked for /v1/models and checked to serve the target; refused first."""
    servers = []
    for url in urls:
        url = base_url(url)
        try:
            models = _http_json(f"{url}/v1/models", None, MODELS_TIMEOUT_S)
        except ReplyError as e:
            raise ExtractError(f"--server {url}: {e}") from e
        servers.append(match_model(url, models, targets, need_len))
    return servers


def completion_request(model: str, prompt: list[int], max_tokens: int, eos_ids: list[int]
                       ) -> dict:
    """Greedy, stopping where the built-in path stops, token ids both ways."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "top_p": 1.0, "n": 1, "stop_token_ids": eos_ids, "return_token_ids": True,
            "skip_special_tokens": False, "stream": False}


def read_completion(reply: dict, prompt: list[int], max_tokens: int, eos_ids: list[int],
                    vocab_size: int) -> list[int]:
    """The completion's token ids, cut after the first eos; ReplyError when they are missing,
    not ids of the target's vocabulary, longer than asked, or stop short of both an eos and
    the cap (the server stopped where greedy decoding would not have)."""
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


def server_continuations(servers: list[Server], prompts: list[tuple[int, list[int]]], *,
                         max_new_tokens: int, eos_ids: list[int], vocab_size: int,
                         in_flight: int, on_done: OnDone | None = None) -> dict[int, list[int]]:
    """{row: greedy new tokens} for each (row, prompt ids), prompt i sent to server i mod n,
    at most `in_flight` requests at a time. The first failure stops the rest and is raised
    as an ExtractError naming the row and the server."""

    def one(i: int, row: int, prompt: list[int]) -> tuple[int, list[int]]:
        server = servers[i % len(servers)]
        cap = max_new_tokens
        if server.max_model_len is not None:  # the stored sample stops at max_length anyway
            cap = min(cap, server.max_model_len - len(prompt))
        try:
            reply = _http_json(f"{server.url}/v1/completions",
                               completion_request(server.model, prompt, cap, eos_ids),
                               COMPLETION_TIMEOUT_S)
            new = read_completion(reply, prompt, cap, eos_ids, vocab_size)
        except ReplyError as e:
            raise ExtractError(f"row {row}: --server {server.url}: {e}; nothing of this row "
                               "was written (re-run to resume)") from e
        if on_done is not None:
            on_done(len(new))
        return row, new

    # Daemon threads, not a ThreadPoolExecutor: after the first failure (or Ctrl-C) the
    # error is raised at once and the process may exit while other generations are still
    # in flight; an executor's threads are joined at exit, up to COMPLETION_TIMEOUT_S each.
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for job in enumerate(prompts):
        jobs.put(job)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    stop, ended = threading.Event(), threading.Semaphore(0)

    def worker() -> None:
        try:
            while not stop.is_set():
                try:
                    i, (row, prompt) = jobs.get_nowait()
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
               for n in range(max(1, min(in_flight, len(prompts))))]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            ended.acquire()
            if errors:
                break
    finally:
        stop.set()
    if errors:
        raise errors[0]
    return {row: results[row] for row, _ in prompts}
