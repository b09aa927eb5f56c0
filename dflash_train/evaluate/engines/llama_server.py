"""llama-server as `eval --served --engine llama.cpp` runs it: found, never assumed
(`find_llama_server`), started on a free local port with one target and one drafter (or none), asked
over HTTP, stopped. Everything it answers is untrusted: this module returns raw JSON and
text, llama_replies.py validates them.

The flags and endpoints are llama.cpp's (b11434; docs/design.md "eval --served --engine
llama.cpp" lists them with file:line): one slot (-np 1), no prompt cache (--no-cache-prompt,
--cache-ram 0), the DFlash drafter (-md, --spec-type draft-dflash, --spec-draft-n-max
block - 1), --metrics for /metrics, no repacking of weights (--no-repack), and LLAMA_TRACE=1
so that it logs each verify step ("accepted A/D draft tokens"), which no response carries.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_train.evaluate.engines.shared import log_tail
from dflash_train.evaluate.errors import EvalError
from dflash_train.ports import free_port

SERVER_VARIABLE = "DFLASH_LLAMA_SERVER"
"""The llama-server binary, when --llama-server is not given."""
DEFAULT_SERVER = (Path.home() / ".cache" / "dflash-train" / "llama.cpp-11434" / "bin"
                  / "llama-server")
"""Where scripts/llama_cpp_build.sh puts it."""
BUILD_HINT = ("build it with `bash scripts/llama_cpp_build.sh` in a dflash-train checkout "
              f"(into {DEFAULT_SERVER}), or give --llama-server PATH (or ${SERVER_VARIABLE})")
READY_SECONDS = 300.0
"""How long loading the target and drafter may take."""
REQUEST_SECONDS = 3600.0
"""How long one prompt's generation may take."""
STALL_SECONDS = 600.0
"""How long a request may go with no answer and no new line in the server's log (each
prompt-processing batch and each verify step logs one): longer, and the server is hung."""
NOTE_SECONDS = 30.0
"""How often a wait for the server is said."""


def check_executable(path: str, what: str) -> str:
    """`path` if it is an executable file, else EvalError naming it and `what` gave it."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"{what} {path}: no such file; {BUILD_HINT}")
    if not os.access(p, os.X_OK):
        raise EvalError(f"{what} {path}: not executable (chmod +x it, or rebuild: {BUILD_HINT})")
    return str(p)


def find_llama_server(explicit: str | None) -> str:
    """--llama-server when given (and only it); else $DFLASH_LLAMA_SERVER; else the build
    script's path. EvalError saying how to build it otherwise."""
    if explicit:
        return check_executable(explicit, "--llama-server")
    from_env = os.environ.get(SERVER_VARIABLE)
    if from_env:
        return check_executable(from_env, f"${SERVER_VARIABLE}")
    if not DEFAULT_SERVER.is_file():
        raise EvalError(f"--served --engine llama.cpp: no llama-server at {DEFAULT_SERVER} "
                        f"and ${SERVER_VARIABLE} is unset; {BUILD_HINT}")
    return check_executable(str(DEFAULT_SERVER), "llama-server")


@dataclass
class ServerSetup:
    """One llama-server: a target, a drafter (or none) and how it runs them."""

    binary: str
    target: str
    drafter: str | None
    """The DFlash GGUF; None: the target decodes alone (the speed baseline)."""
    block_size: int
    context: int
    """Its context size (-c): the longest prompt, the generation and a block of room."""
    threads: int
    log: Path


def server_command(setup: ServerSetup, port: int) -> list[str]:
    threads = str(setup.threads)
    drafter = [] if setup.drafter is None else [
        "-md", setup.drafter, "--spec-type", "draft-dflash",
        "--spec-draft-n-max", str(setup.block_size - 1), "-td", threads]
    return [setup.binary, "-m", setup.target, *drafter,
            "-np", "1", "--no-cache-prompt", "--cache-ram", "0", "--no-repack", "--metrics",
            "-c", str(setup.context), "-t", threads,
            "--host", "127.0.0.1", "--port", str(port), "--log-colors", "off", "--no-webui"]


class LlamaServer:
    """A running llama-server; a context manager that always stops it, SIGTERM to this
    process included (which would otherwise end it without stopping the server)."""

    def __init__(self, setup: ServerSetup, note: Callable[[str], None] | None = None):
        self.setup = setup
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.note = note or (lambda _: None)
        """Told when a wait for the server goes on (every NOTE_SECONDS)."""
        self._sigterm = None

    def __enter__(self) -> "LlamaServer":
        env = dict(os.environ, LLAMA_TRACE="1")  # one log line per verify step
        if threading.current_thread() is threading.main_thread():
            self._sigterm = signal.signal(signal.SIGTERM, self._terminated)
        try:
            with open(self.setup.log, "w") as out:
                self.process = subprocess.Popen(server_command(self.setup, self.port),
                                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                                stdin=subprocess.DEVNULL)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _terminated(self, signum, frame) -> None:
        """SIGTERM: leave through __exit__ (which stops the server), exiting as SIGTERM's
        default would (128 + 15)."""
        pid = self.process.pid if self.process is not None else None
        print(f"eval: SIGTERM: stopping the llama-server it started (pid {pid})",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    def stop(self) -> None:
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def failure(self, what: str) -> EvalError:
        code = None if self.process is None else self.process.poll()
        state = "running" if code is None else f"exited with status {code}"
        return EvalError(f"llama-server ({self.setup.binary}, {state}) {what}; full log "
                         f"{self.setup.log}; its end:\n  {log_tail(self.setup.log)}")

    def wait_ready(self) -> None:
        """Until /health answers 200 (503 while it loads); EvalError if it exits first."""
        start = time.monotonic()
        deadline, said = start + READY_SECONDS, start
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                drafter = ("without a drafter" if self.setup.drafter is None else
                           f"with drafter {self.setup.drafter}")
                raise self.failure(f"did not load {self.setup.target} {drafter}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - said >= NOTE_SECONDS:
                said = time.monotonic()
                self.note(f"waiting for llama-server to load {self.setup.target} "
                          f"({said - start:.0f} s so far; it gets {READY_SECONDS:.0f} s)")
            time.sleep(0.2)
        raise self.failure(f"was not ready after {READY_SECONDS:.0f} s (hung loading?)")

    def _call(self, path: str, body: dict | None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            raise self.failure(f"answered {path} with HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            raise self.failure(f"stopped answering {path} ({e})") from e

    def complete(self, body: dict, what: str = "a prompt") -> bytes:
        """POST /completion; its raw answer. The server must answer, or at least log a line,
        every STALL_SECONDS: else it is taken as hung (EvalError; the caller's `with`
        stops it, which also ends the request left waiting)."""
        answer: list = []
        request = threading.Thread(target=self._answer_into, args=(answer, body), daemon=True)
        request.start()
        start = time.monotonic()
        said = seen = start
        size = self.log_size()
        while request.is_alive():
            request.join(timeout=0.2)
            now = time.monotonic()
            if (grown := self.log_size()) != size:
                size, seen = grown, now
            if request.is_alive() and now - seen > STALL_SECONDS:
                raise self.failure(f"answered nothing and logged nothing for "
                                   f"{now - seen:.0f} s on {what} (hung?); gave up")
            if request.is_alive() and now - said >= NOTE_SECONDS:
                said = now
                self.note(f"waiting for llama-server on {what} ({now - start:.0f} s so far; "
                          f"it is given up after {STALL_SECONDS:.0f} s without a log line)")
        if isinstance(answer[0], BaseException):
            raise answer[0]
        return answer[0]

    def _answer_into(self, answer: list, body: dict) -> None:
        try:
            answer.append(self._call("/completion", body))
        except BaseException as e:  # handed to the waiting thread, which raises it
            answer.append(e)

    def metrics(self) -> str:
        """GET /metrics: Prometheus text."""
        return self._call("/metrics", None).decode(errors="replace")

    def log_size(self) -> int:
        try:
            return self.setup.log.stat().st_size
        except OSError:  # removed under it: no growth to see
            return -1

    def read_log(self, offset: int) -> str:
        """Its log from byte `offset` to the last complete line."""
        with open(self.setup.log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        return text[: text.rfind("\n") + 1]
