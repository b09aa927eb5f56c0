"""`extract --regenerate --server URL`: a fake vLLM (http.server in a thread, answering from the
tiny target's own greedy decoding without a cache) must give the built-in store token for token;
a server of another model, an error or a malformed reply is refused naming what and where."""

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_train.extract.errors import ExtractError
from dflash_train.extract.server_generate import ReplyError, match_model, read_completion
from dflash_train.extract.writer import KILL_AFTER_ENV
from dflash_train.store_schema import open_store, validate
from dflash_train.store_schema.info import top1_agreement
from tests.evaluate.conftest import EOS_ID
from tests.extract.conftest import (
    assert_same_samples,
    cli_args,
    run_cli,
    run_extract_cfg,
    store_samples,
)

NEW = 8


class FakeVllm:
    """Answers /v1/models and /v1/completions as vLLM does (token ids in, token ids out)."""

    def __init__(self, model_dir: str, served_id: str | None = None, max_model_len: int = 4096):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.card = {"id": served_id or model_dir, "object": "model", "root": served_id or
                     model_dir, "max_model_len": max_model_len}
        self.lock = threading.Lock()
        self.prompts: list[list[int]] = []
        self.busy, self.busy_lock = 0, threading.Lock()
        """Requests being answered (a killed client's included, until their reply fails);
        counted under a lock of their own, not behind the one generation holds."""
        self.fail: dict[tuple, tuple[int, dict]] = {}
        """prompt ids -> (HTTP status, body) answered instead of a completion."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200, {"object": "list", "data": [fake.card]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.busy_lock:
                    fake.busy += 1
                try:
                    self._send(*fake.complete(body))
                finally:
                    with fake.busy_lock:
                        fake.busy -= 1

            def _send(self, status: int, reply: dict):
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def complete(self, body: dict) -> tuple[int, dict]:
        prompt = body["prompt"]
        with self.lock:
            self.prompts.append(prompt)
        if tuple(prompt) in self.fail:
            return self.fail[tuple(prompt)]
        assert body["temperature"] == 0 and body["return_token_ids"] is True
        assert body["model"] == self.card["id"]
        ids, stop = list(prompt), set(body["stop_token_ids"])
        with self.lock, torch.no_grad():
            for _ in range(body["max_tokens"]):
                ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
                if ids[-1] in stop:
                    break
        new = ids[len(prompt):]
        finish = "stop" if new[-1] in stop else "length"
        return 200, {"choices": [{"index": 0, "text": "", "token_ids": new,
                                  "prompt_token_ids": prompt, "finish_reason": finish}]}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def builtin(target, data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("builtin") / "hs.zarr")
    # the forward's states, as a server's answers get them (the built-in generation's own
    # differ by float rounding: tests/extract/test_capture_in_generation.py)
    run_extract_cfg(target, data, out, regenerate=True, max_new_tokens=NEW, capture="forward")
    return store_samples(out)


@pytest.fixture
def server(target):
    fake = FakeVllm(target)
    yield fake
    fake.close()


def test_a_store_regenerated_through_servers_equals_the_builtin_one(target, data, builtin,
                                                                    tmp_path):
    servers = [FakeVllm(target), FakeVllm(target)]
    try:
        out = str(tmp_path / "hs.zarr")
        run_extract_cfg(target, data, out, regenerate=True, max_new_tokens=NEW,
                        servers=[s.url for s in servers[:1]] + [servers[1].url + "/v1/"],
                        server_requests=3)
        assert_same_samples(store_samples(out), builtin)
        assert validate(out) == []
        agree, answers = top1_agreement(open_store(out))  # one fp32 model on both sides
        assert agree == answers == sum(int(s.loss_mask.sum()) for s in builtin)
        # both servers did their share, each prompt was asked once
        assert all(s.prompts for s in servers)
        assert sum(len(s.prompts) for s in servers) == len(builtin)
    finally:
        for s in servers:
            s.close()
    ends = [s.input_ids[-1].item() == EOS_ID for s in builtin]
    assert any(ends) and not all(ends), "test needs answers ending on eos and on the cap"


def test_the_next_part_is_generated_while_this_part_runs_its_forward(target, data, builtin,
                                                                     server, tmp_path,
                                                                     monkeypatch):
    """Part 1's first forward waits until the server is asked for a prompt past part 1's
    rows (5 a part): only generating ahead gets there; one-part-at-a-time extract times out.
    (Part 0 generates nothing ahead: the agreement check after it comes first.)"""
    from dflash_train.extract import fill

    forward, overlapped = fill._forward_batch, []

    def forward_once_overlapped(*args, **kwargs):
        if not overlapped and len(server.prompts) >= 10:  # in part 1
            deadline = time.monotonic() + 30
            while len(server.prompts) <= 10 and time.monotonic() < deadline:
                time.sleep(0.01)
            overlapped.append(len(server.prompts) > 10)
        return forward(*args, **kwargs)

    monkeypatch.setattr(fill, "_forward_batch", forward_once_overlapped)
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(target, data, out, regenerate=True, max_new_tokens=NEW, rows_per_part=5,
                    servers=[server.url])
    assert overlapped == [True]
    assert_same_samples(store_samples(out), builtin)
    assert len(server.prompts) == len(builtin)  # each prompt asked once, none ahead in vain


def test_a_server_of_another_model_is_refused_before_anything_is_written(target, data,
                                                                          tmp_path):
    other = FakeVllm(target, served_id="Qwen/Qwen3-8B")
    try:
        out = tmp_path / "hs.zarr"
        with pytest.raises(ExtractError, match=r"serves \['Qwen/Qwen3-8B'\], not --model"):
            run_extract_cfg(target, data, str(out), regenerate=True, max_new_tokens=NEW,
                            servers=[other.url])
        assert not out.exists() and other.prompts == []
    finally:
        other.close()


def test_a_server_too_short_for_the_samples_is_refused(target, data, tmp_path):
    short = FakeVllm(target, served_id=Path(target).name, max_model_len=8)
    try:
        with pytest.raises(ExtractError, match="max_model_len 8.*--max-model-len"):
            run_extract_cfg(target, data, str(tmp_path / "hs.zarr"), regenerate=True,
                            max_new_tokens=NEW, servers=[short.url])
    finally:
        short.close()


def test_server_needs_regenerate(target, data, server, tmp_path):
    with pytest.raises(ExtractError, match="needs --regenerate"):
        run_extract_cfg(target, data, str(tmp_path / "hs.zarr"), servers=[server.url])


def test_a_server_error_names_the_row_and_the_server(target, data, builtin, server,
                                                     tmp_path):
    row = builtin[7]
    prompt = row.input_ids[~row.loss_mask].tolist()
    server.fail[tuple(prompt)] = (500, {"error": "out of memory"})
    with pytest.raises(ExtractError, match=rf"row 7: --server {server.url}: HTTP 500 .*"
                                           "out of memory"):
        run_extract_cfg(target, data, str(tmp_path / "hs.zarr"), regenerate=True,
                        max_new_tokens=NEW, servers=[server.url])


def test_a_killed_run_resumes_without_asking_for_what_it_kept(target, data, builtin, server,
                                                               tmp_path):
    out = str(tmp_path / "hs.zarr")
    args = cli_args(target, data, out) + ["--regenerate", "--max-new-tokens", str(NEW),
                                          "--server", server.url]
    killed = run_cli(args, **{KILL_AFTER_ENV: "4"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    kept = {int(r) for p in open_store(out).parts() for r in p.sources()}
    assert kept and len(kept) < len(builtin)
    # the killed run had the next part's generation in flight: let those requests end first
    deadline = time.monotonic() + 60
    while server.busy and time.monotonic() < deadline:
        time.sleep(0.05)
    server.prompts.clear()
    run_extract_cfg(target, data, out, regenerate=True, max_new_tokens=NEW,
                    servers=[server.url])
    assert_same_samples(store_samples(out), builtin)
    kept_prompts = [s.input_ids[~s.loss_mask].tolist() for s in builtin if s.source_row in kept]
    assert not any(p in server.prompts for p in kept_prompts)
    assert len(server.prompts) == len(builtin) - len(kept)


def _reply(ids, **choice) -> dict:
    return {"choices": [{"token_ids": ids, **choice}]}


@pytest.mark.parametrize("reply, why", [
    ({"choices": []}, "no single choice"),
    (_reply(None, text="a b c"), "no token ids"),
    (_reply([1, 2.0, 3, 4]), "token id 2.0 is not"),
    (_reply([1, float("nan"), 3, 4]), "token id nan is not"),
    (_reply([1, True, 3, 4]), "token id True is not"),
    (_reply([1, 500, 3, 4]), "token id 500 is not"),
    (_reply([1, -1, 3, 4]), "token id -1 is not"),
    (_reply([5, 6], finish_reason="stop"), "2 tokens, no eos and not the 4 asked"),
    (_reply([5, 6, 7, 8, 9]), "5 tokens, no eos"),
    (_reply([5, 6, 7, 8], prompt_token_ids=[1, 2]), "another prompt"),
])
def test_malformed_replies_are_refused(reply, why):
    with pytest.raises(ReplyError, match=why):
        read_completion(reply, [1, 2, 3], max_tokens=4, eos_ids=[3], vocab_size=300)


def test_a_completion_is_kept_verbatim_up_to_its_first_eos():
    assert read_completion(_reply([5, 3, 7]), [1], 4, [3], 300) == [5, 3]
    assert read_completion(_reply([5, 6, 7, 8]), [1], 4, [3], 300) == [5, 6, 7, 8]


def test_models_are_matched_by_id_root_or_last_path_component():
    card = {"id": "tiny", "root": "/models/qwen3-tiny", "max_model_len": 64}
    for target in ("tiny", "/models/qwen3-tiny", "/elsewhere/qwen3-tiny/", "org/qwen3-tiny"):
        assert match_model("u", {"data": [card]}, [target], 64).model == "tiny"
    with pytest.raises(ExtractError, match="not --model qwen3-big"):
        match_model("u", {"data": [card]}, ["qwen3-big"], 64)
    with pytest.raises(ExtractError, match="no list of models"):
        match_model("u", {"object": "list"}, ["tiny"], 64)


SLOW_SERVER_RUN = r'''
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.server_generate import Ask, Server, server_continuations

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"] != [1]:
            time.sleep(30)  # a long generation still in flight
        data = b'{"choices": []}'  # prompt [1]: a malformed reply, at once
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=httpd.serve_forever, daemon=True).start()
server = Server(f"http://127.0.0.1:{httpd.server_address[1]}", "m", None)
try:
    server_continuations([server], [(5, [2]), (6, [3]), (7, [1])], Ask(4, [0], 10),
                         in_flight=3)
except ExtractError as e:
    print(e)
    sys.exit(3)
'''


def test_a_failed_request_ends_the_process_without_waiting_for_those_in_flight():
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SLOW_SERVER_RUN], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 3, done.stderr[-2000:]
    assert "row 7: --server http://127.0.0.1:" in done.stdout
    assert time.monotonic() - start < 20  # the two other requests would hold it 30 s


def test_answers_running_past_max_length_meet_overlong_as_the_builtin_ones_do(target, data,
                                                                               tmp_path):
    """A server must hold max_length + 1 tokens: one capped at exactly max_length would hand
    back answers cut to fit, which --overlong skip then keeps where the built-in path skips."""
    settings = dict(regenerate=True, max_new_tokens=NEW, max_length=34, overlong="skip",
                    capture="forward")
    run_extract_cfg(target, data, str(tmp_path / "builtin.zarr"), **settings)
    builtin = store_samples(str(tmp_path / "builtin.zarr"))
    assert 0 < len(builtin) < 14  # some answers ran past 34 tokens and were skipped
    exact = FakeVllm(target, max_model_len=34)
    roomy = FakeVllm(target, max_model_len=35)
    try:
        with pytest.raises(ExtractError, match="max_model_len 34.*--max-model-len 35"):
            run_extract_cfg(target, data, str(tmp_path / "exact.zarr"), servers=[exact.url],
                            **settings)
        run_extract_cfg(target, data, str(tmp_path / "roomy.zarr"), servers=[roomy.url],
                        **settings)
        assert_same_samples(store_samples(str(tmp_path / "roomy.zarr")), builtin)
    finally:
        exact.close()
        roomy.close()
