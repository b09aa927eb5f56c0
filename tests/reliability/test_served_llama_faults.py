"""`eval --served --engine llama.cpp` against a llama-server that hangs (loading, or on a
request), and eval itself stopped by SIGTERM, with a stand-in server
(tests/reliability/fake_llama_server.py). A hang is given up with one error naming what
was awaited and quoting the log, after lines saying what eval waits for; a slow server that
keeps logging is waited for; SIGTERM stops the server eval started."""

import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.evaluate.engines import llama_server as server_mod
from dflash_train.evaluate.engines.llama_server import LlamaServer, ServerSetup
from dflash_train.evaluate.errors import EvalError
from tests.processes import is_running

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake_llama_server.py")


@pytest.fixture
def server(tmp_path, monkeypatch):
    """(a ServerSetup running the stand-in, its pid file); the mode is set per test."""
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    pid_file = tmp_path / "server.pid"
    monkeypatch.setenv("FAKE_LLAMA_PID", str(pid_file))
    monkeypatch.setattr(server_mod, "NOTE_SECONDS", 0.5)
    setup = ServerSetup(str(binary), "t.gguf", "d.gguf", 8, 64, 1, tmp_path / "server.log")
    return setup, pid_file



def test_a_server_hung_on_a_request_is_given_up_naming_it_and_stopped(server, monkeypatch):
    setup, pid_file = server
    monkeypatch.setenv("FAKE_LLAMA_MODE", "hang")
    monkeypatch.setattr(server_mod, "STALL_SECONDS", 1.5)
    notes = []
    with pytest.raises(EvalError) as e:
        with LlamaServer(setup, note=notes.append) as running:
            running.complete({"prompt": [1, 2, 3]}, "prompt 0/7")
    said = str(e.value)
    assert re.search(r"answered nothing and logged nothing for \d s on prompt 0/7 \(hung\?\); "
                     "gave up", said), said
    assert f"full log {setup.log}" in said and "running" in said
    assert notes and all(n.startswith("waiting for llama-server on prompt 0/7 (") for n in notes)
    assert "given up after 2 s without a log line" in notes[0]
    assert not is_running(int(pid_file.read_text()))


def test_a_slow_server_that_keeps_logging_is_waited_for(server, monkeypatch):
    setup, pid_file = server
    monkeypatch.setenv("FAKE_LLAMA_MODE", "slow")  # answers after 2.4 s, a line every 0.3 s
    monkeypatch.setattr(server_mod, "STALL_SECONDS", 1.0)
    notes = []
    with LlamaServer(setup, note=notes.append) as running:
        raw = running.complete({"prompt": [1, 2, 3]}, "prompt 0/7")
    assert b'"tokens": [20]' in raw
    assert any("waiting for llama-server on prompt 0/7" in n for n in notes)
    assert not is_running(int(pid_file.read_text()))


def test_a_server_hung_loading_is_given_up_saying_so(server, monkeypatch):
    setup, pid_file = server
    monkeypatch.setenv("FAKE_LLAMA_MODE", "hang_loading")
    monkeypatch.setattr(server_mod, "READY_SECONDS", 1.5)
    notes = []
    with pytest.raises(EvalError, match=r"was not ready after 2 s \(hung loading\?\)"):
        with LlamaServer(setup, note=notes.append):
            pass
    assert any(n.startswith("waiting for llama-server to load t.gguf (") for n in notes), notes
    assert not is_running(int(pid_file.read_text()))


EVAL_WAITING = """
import sys
from pathlib import Path
from dflash_train.evaluate.engines.llama_server import LlamaServer, ServerSetup
setup = ServerSetup(sys.argv[1], "t.gguf", "d.gguf", 8, 64, 1, Path(sys.argv[2]))
with LlamaServer(setup) as server:
    print("waiting", flush=True)
    server.complete({"prompt": [1, 2, 3]}, "prompt 0/7")
"""


def test_sigterm_to_eval_stops_the_server_it_started(server, monkeypatch):
    setup, pid_file = server
    monkeypatch.setenv("FAKE_LLAMA_MODE", "hang")
    proc = subprocess.Popen([sys.executable, "-c", EVAL_WAITING, setup.binary, str(setup.log)],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "waiting\n", proc.stderr.read()
        server_pid = int(pid_file.read_text())
        assert is_running(server_pid)
        proc.send_signal(signal.SIGTERM)  # to eval alone, as a job scheduler sends it
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip() == f"eval: SIGTERM: stopping the llama-server it started (pid " \
                          f"{server_pid})", err
    assert not is_running(server_pid)
