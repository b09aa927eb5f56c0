"""llama-server as `eval --served --engine llama.cpp` runs it: found, never assumed
(`find_llama_server`), started on a free local port with one target and one drafter, asked
over HTTP, stopped. Everything it answers is untrusted: this module returns raw JSON and
text, served_llama.py validates them.

The flags and endpoints are llama.cpp's (b11434; docs/design.md "eval --served --engine
llama.cpp" lists them with file:line): one slot (-np 1), no prompt cache (--no-cache-prompt,
--cache-ram 0), the DFlash drafter (-md, --spec-type draft-dflash, --spec-draft-n-max
block - 1), --metrics for /metrics, no repacking of weights (--no-repack), and LLAMA_TRACE=1
so that it logs each verify step ("accepted A/D draft tokens"), which no response carries.
"""

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dflash_train.evaluate.errors import EvalError

SERVER_VARIABLE = "DFLASH_LLAMA_SERVER"
"""The llama-server binary, when --llama-server is not given."""
DEFAULT_SERVER = (Path.home() / ".cache" / "dflash-train" / "llama.cpp-11434" / "bin"
                  / "llama-server")
"""Where scripts/llama_cpp_build.sh puts it."""
BUILD_HINT = ("build it with `bash scripts/llama_cpp_build.sh` in a dflash-train checkout "
              f"(into {DEFAULT_SERVER}), or give --llama-server PATH (or ${SERVER_VARIABLE})")
_LOG_TAIL = 12
"""Lines of its log quoted when it fails."""
READY_SECONDS = 300.0
"""How long loading the target and drafter may take."""
REQUEST_SECONDS = 3600.0
"""How long one prompt's generation may take."""


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


def log_tail(log: Path) -> str:
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    return "\n  ".join(lines[-_LOG_TAIL:])


def free_port() -> int:
    """A local port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSetup:
    """One llama-server: a target, a drafter and how it runs them."""

    binary: str
    target: str
    drafter: str
    block_size: int
    context: int
    """Its context size (-c): the longest prompt, the generation and a block of room."""
    threads: int
    log: Path


def server_command(setup: ServerSetup, port: int) -> list[str]:
    threads = str(setup.threads)
    return [setup.binary, "-m", setup.target, "-md", setup.drafter,
            "--spec-type", "draft-dflash", "--spec-draft-n-max", str(setup.block_size - 1),
            "-np", "1", "--no-cache-prompt", "--cache-ram", "0", "--no-repack", "--metrics",
            "-c", str(setup.context), "-t", threads, "-td", threads,
            "--host", "127.0.0.1", "--port", str(port), "--log-colors", "off", "--no-webui"]


class LlamaServer:
    """A running llama-server; a context manager that always stops it."""

    def __init__(self, setup: ServerSetup):
        self.setup = setup
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        env = dict(os.environ, LLAMA_TRACE="1")  # one log line per verify step
        with open(self.setup.log, "w") as out:
            self.process = subprocess.Popen(server_command(self.setup, self.port), stdout=out,
                                            stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
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
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self.failure(f"did not load {self.setup.target} with drafter "
                                   f"{self.setup.drafter}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise self.failure(f"was not ready after {READY_SECONDS:.0f} s")

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

    def complete(self, body: dict) -> bytes:
        """POST /completion; its raw answer."""
        return self._call("/completion", body)

    def metrics(self) -> str:
        """GET /metrics: Prometheus text."""
        return self._call("/metrics", None).decode(errors="replace")

    def log_size(self) -> int:
        return self.setup.log.stat().st_size

    def read_log(self, offset: int) -> str:
        """Its log from byte `offset` to the last complete line."""
        with open(self.setup.log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        return text[: text.rfind("\n") + 1]
