"""The transport under `extract --server`: what a server URL may be, and one JSON request.

Owns the two places a user's server can go wrong before a reply is read as a completion:
the URL (checked before anything is contacted or written) and the exchange (every way a
connection, an HTTP answer or a body can fail becomes one ReplyError saying what happened,
never an http.client or socket traceback). Standard library only; knows nothing of models
or completions (server_generate.py reads those).
"""

import http.client
import json
import math
import socket
import urllib.error
import urllib.parse
import urllib.request

from dflash_train.extract.errors import ExtractError
from dflash_train.json_fields import is_number

URL_EXAMPLE = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 600.0
"""--server-timeout's default: a non-streaming completion answers only once it is whole, and
1024 tokens at 10 tokens/s per sequence on a busy server take 100 s; a silent server is
still given up on within ten minutes."""


class ReplyError(Exception):
    """A reply that is not a greedy continuation we can store; the message says why."""


def server_url(url: str) -> str:
    """`url` as a base URL (no trailing / or /v1); ExtractError naming it when urllib could
    not send a request to it (another scheme, no host, a port that is not a number, a
    bracket left open), so a typo is refused before the model loads."""
    why = _url_problem(url)
    if why:
        raise ExtractError(f"--server {url!r} is not a server URL ({why}); give one like "
                           f"{URL_EXAMPLE}")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _url_problem(url: str) -> str | None:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # parsed lazily: a port that is not a number raises only here
    except ValueError as e:
        return str(e)
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme or 'missing'!r}, not http or https"
    if not parts.hostname:
        return "no host"
    if port == 0:
        return "port 0"
    if parts.query or parts.fragment:
        return "a query or fragment has no place in a base URL"
    return None


def check_timeout(seconds: float) -> float:
    """--server-timeout as given, refused unless a finite number of seconds > 0."""
    if not is_number(seconds) or not (math.isfinite(seconds) and seconds > 0):
        raise ExtractError(f"--server-timeout must be a finite number of seconds > 0, got "
                           f"{seconds!r}")
    return float(seconds)


def http_json(url: str, body: dict | None, timeout: float) -> dict:
    """POST `body` (GET when None) to `url` and return the JSON object it answers; any other
    outcome is a ReplyError: an HTTP error status, no answer within `timeout` seconds of
    silence, a refused or dropped connection, an answer that is not HTTP, a body cut short,
    a body that is not a JSON object."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        raise ReplyError(f"HTTP {e.code} from {url}: {_error_detail(e)}") from e
    except Exception as e:  # every transport failure, in words by _transport
        raise ReplyError(_transport(url, e, timeout)) from e
    try:
        reply = json.loads(raw)
    except ValueError as e:
        raise ReplyError(f"{url} answered with something that is not JSON ({e})") from e
    if not isinstance(reply, dict):
        raise ReplyError(f"{url} answered with a JSON {type(reply).__name__}, not an object")
    return reply


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        return e.read()[:300].decode(errors="replace").replace("\n", " ")
    except (OSError, http.client.HTTPException):  # the error page itself was cut short
        return e.reason or "(no readable body)"


def _transport(url: str, e: Exception, timeout: float) -> str:
    """What went wrong between us and the server, in words, for one failed exchange."""
    cause = getattr(e, "reason", e) if isinstance(e, urllib.error.URLError) else e
    if isinstance(cause, (TimeoutError, socket.timeout)):
        return (f"no answer from {url} within {timeout:g} s (--server-timeout): the server "
                "took the request and went silent; raise --server-timeout for long "
                "generations on a busy server, or check it")
    if isinstance(cause, http.client.IncompleteRead):
        more = f", {cause.expected} more expected" if cause.expected else ""
        return (f"{url} cut its answer short ({len(cause.partial)} bytes read{more}): the "
                "connection dropped mid-reply")
    if isinstance(cause, http.client.RemoteDisconnected):
        return f"{url} closed the connection without answering"
    if isinstance(cause, http.client.HTTPException):  # BadStatusLine, LineTooLong, ...
        return (f"{url} did not answer in HTTP ({type(cause).__name__}: {cause}): is it an "
                "OpenAI-compatible server?")
    if isinstance(cause, OSError):
        return f"cannot reach {url} ({cause.strerror or cause})"
    return f"cannot talk to {url} ({type(cause).__name__}: {cause})"
