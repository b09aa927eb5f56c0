"""eval --served --engine llama.cpp without llama-server: reading its answers, its /metrics and
its per-step log (all untrusted), turning them into rounds under --online's stop rule, finding
(or not finding) the binary, and the option checks. The real runs are in
test_served_llama.py (marked llama_cpp)."""

import json
import stat
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_train.evaluate.command import eval_command
from dflash_train.evaluate.engines import llama_cpp as llama_mod
from dflash_train.evaluate.engines import llama_server as server_mod
from dflash_train.evaluate.engines.llama_cpp import request_body, serve_prompt
from dflash_train.evaluate.engines.llama_replies import (
    check_steps,
    metrics_agree,
    parse_completion,
    parse_metrics,
    parse_steps,
    printed_equal,
)
from dflash_train.evaluate.engines.llama_server import (
    LlamaServer,
    ServerSetup,
    find_llama_server,
)
from dflash_train.evaluate.engines.shared import ServedResults, ServeJob
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.online import StopRule
from dflash_train.evaluate.report import format_table
from tests.evaluate.conftest import EOS_ID
from tests.evaluate.test_online import PROMPT
from tests.evaluate.test_served import BIN, _online, _prompt, _report_with_served

VOCAB = 512
WHERE = "llama-server, prompt 0/0"
METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6
llamacpp:spec_decode_num_draft_tokens_total 1.23457e+06
llamacpp:spec_decode_num_accepted_tokens_total 9
llamacpp:spec_decode_num_drafts_total 2
llamacpp:requests_processing 0
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 2
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1
"""


def answer(tokens, stop="limit", evaluated=3, **timings) -> bytes:
    """A /completion answer as llama-server writes it (the fields we read) to a 3-token
    prompt."""
    return json.dumps({"tokens": tokens, "stop_type": stop, "tokens_evaluated": evaluated,
                       "timings": {"predicted_n": len(tokens), "predicted_ms": 1.0,
                                   **timings}}).encode()


def log_of(steps, task=5) -> str:
    """The log lines one request leaves with LLAMA_TRACE=1 (timestamps as it prints them)."""
    lines = [f"0.10.{i:03d}.000 I slot   operator(): id  0 | task {task} | accepted "
             f"{a:2d}/{d:2d} draft tokens" for i, (a, d) in enumerate(steps)]
    lines.append(f"0.11.000.000 I slot      release: id  0 | task {task} | stop processing: "
                 "n_tokens = 29, truncated = 0")
    return "\n".join(lines) + "\n"


def test_an_answer_is_read_and_every_field_checked():
    done = parse_completion(answer([20, 21], draft_n=7, draft_n_accepted=1), 3, VOCAB, WHERE)
    assert (done.tokens, done.stop_type, done.draft_n, done.draft_accepted) == \
        ([20, 21], "limit", 7, 1)
    # nothing drafted: llama-server leaves both counts out
    assert parse_completion(answer([20]), 3, VOCAB, WHERE).draft_n == 0
    bad = [(b"<html>busy</html>", "not JSON"), (b"[1, 2]", "a list, not an object"),
           (answer([]), "no generated token ids"),
           (answer([20, VOCAB]), f"id {VOCAB} is outside the {VOCAB}-token vocabulary"),
           (answer([20, True]), "is True, not an integer"),
           (answer([20], evaluated=4), "evaluated 4 prompt tokens, we sent 3"),
           (answer([20], stop="word"), "stop_type 'word'"),
           (answer([20], draft_n=-1), "timings.draft_n is -1"),
           (json.dumps({"tokens": [20], "stop_type": "eos", "tokens_evaluated": 3}).encode(),
            "no `timings` object")]
    for raw, message in bad:
        with pytest.raises(EvalError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_completion(raw, 3, VOCAB, WHERE)
    mismatch = json.loads(answer([20, 21]))
    mismatch["timings"]["predicted_n"] = 3
    with pytest.raises(EvalError, match="predicted_n 3 but 2 token ids"):
        parse_completion(json.dumps(mismatch).encode(), 3, VOCAB, WHERE)


def test_metrics_are_read_by_name_and_compared_as_llama_server_prints_them():
    metrics = parse_metrics(METRICS, WHERE)
    assert metrics == {"num_drafts": 2, "num_draft_tokens": 1.23457e+06,
                       "num_accepted_tokens": 9, "accepted_per_pos": [2, 2, 1]}
    # 6 significant digits, as C++ streams a double by default
    assert printed_equal(1.23457e+06, 1234567) and not printed_equal(1.23457e+06, 1234600)
    assert printed_equal(133.0, 133) and not printed_equal(None, 0)
    with pytest.raises(EvalError, match="no llamacpp:spec_decode_num_drafts_total"):
        parse_metrics(METRICS.replace("llamacpp:spec_decode_num_drafts_total 2\n", ""), WHERE)
    with pytest.raises(EvalError, match="has no number"):
        parse_metrics(METRICS + "llamacpp:n_busy_slots_per_decode nan?\n", WHERE)
    with pytest.raises(EvalError, match=r"positions \[0, 2, 3\], not 0..2"):
        parse_metrics(METRICS.replace('position="1"', 'position="3"'), WHERE)


def test_the_counters_agree_only_when_every_step_is_in_metrics():
    steps = [(2, 7), (7, 7)]
    metrics = {"num_drafts": 2, "num_draft_tokens": 14, "num_accepted_tokens": 9,
               "accepted_per_pos": [2, 2, 1, 1, 1, 1, 1]}
    assert metrics_agree(metrics, steps, 8)
    assert not metrics_agree(metrics, steps + [(0, 7)], 8)
    assert not metrics_agree(dict(metrics, accepted_per_pos=[2, 2, 1]), steps, 8)


def test_the_log_gives_the_steps_of_the_request_it_ends():
    assert parse_steps(log_of([(2, 7), (0, 7)]), WHERE) == ([(2, 7), (0, 7)], True)
    assert parse_steps(log_of([]), WHERE) == ([], True)  # the first token ended it
    unfinished = log_of([(2, 7)]).splitlines()[0] + "\n"
    assert parse_steps(unfinished, WHERE) == ([], False)  # its worker has not logged the end
    restore = log_of([(2, 7)]).replace("draft tokens", "draft tokens (restore checkpoint)")
    with pytest.raises(EvalError, match="restored a checkpoint"):
        parse_steps(restore, WHERE)


def test_steps_must_add_up_to_the_answer():
    done = parse_completion(answer([20] * 5, draft_n=14, draft_n_accepted=3), 3, VOCAB, WHERE)
    check_steps([(2, 7), (1, 7)], done, 8, WHERE)
    with pytest.raises(EvalError, match="2 steps drafted 14 and accepted 2, its answer says "
                                        "14 and 3"):
        check_steps([(2, 7), (0, 7)], done, 8, WHERE)
    with pytest.raises(EvalError, match="step 1 accepted 1 of 9 drafts"):
        check_steps([(2, 7), (1, 9)], done, 8, WHERE)


class FakeServer:
    """Answers one request as llama-server would, logging its steps."""

    def __init__(self, raw: bytes, log: str):
        self.raw, self.log, self.bodies = raw, log, []

    def log_size(self) -> int:
        return 0

    def complete(self, body: dict, what: str = "a prompt") -> bytes:
        self.bodies.append(body)
        return self.raw

    def read_log(self, offset: int) -> str:
        return self.log


def test_a_cap_is_applied_where_online_applies_it_and_later_steps_are_left_out():
    # test_served's cap case (B = 8, 7 new tokens: --online commits 3 then 3). llama-server
    # was asked for a block more (n_predict 15): it went on past the cap, a third step too.
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=7, max_length=100)
    online, tokens = _online(list(range(20, 40)), {6}, 8, stop)
    generated = list(range(20, 35))  # 1 + 3 + 8 + 3 tokens
    server = FakeServer(answer(generated, draft_n=21, draft_n_accepted=11),
                        log_of([(2, 7), (7, 7), (2, 7)]))
    prompt = _prompt(tokens, max_tokens=7)
    served = serve_prompt(server, prompt, 8, stop, VOCAB, "s")
    assert server.bodies == [request_body(prompt, 8)]
    assert server.bodies[0]["n_predict"] == 15 and server.bodies[0]["prompt"] == PROMPT
    assert server.bodies[0]["temperature"] == 0 and server.bodies[0]["cache_prompt"] is False
    assert served.decode.tokens == tokens and served.decode.accepted == [2, 7]
    assert served.decode.committed == [3, 3] and len(served.steps) == 3 and not served.early_eog
    results = ServedResults("s", 8, [served.decode], {}, BIN, "llama_cpp",
                            counters_agree=True)
    assert results.walks[None].rounds == online.walks[None].rounds
    assert results.summary().to_json()["llama_cpp"]["num_accepted_tokens"] == 9  # its convention


def test_an_end_of_generation_online_does_not_stop_on_is_flagged():
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=50, max_length=100)
    other_eog = 7
    server = FakeServer(answer([20, 21, other_eog], stop="eos", draft_n=7, draft_n_accepted=1),
                        log_of([(1, 7)]))
    served = serve_prompt(server, _prompt(PROMPT + [20, 21, other_eog]), 8, stop, VOCAB, "s")
    assert served.early_eog and served.decode.committed == [2]
    server = FakeServer(answer([20, EOS_ID], stop="eos", draft_n=7, draft_n_accepted=0),
                        log_of([(0, 7)]))
    assert not serve_prompt(server, _prompt(PROMPT + [20, EOS_ID]), 8, stop, VOCAB,
                            "s").early_eog


def test_the_table_names_llama_cpp_and_its_counters():
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=7, max_length=100)
    online, tokens = _online(list(range(20, 40)), {6}, 8, stop)
    server = FakeServer(answer(list(range(20, 35)), draft_n=21, draft_n_accepted=11),
                        log_of([(2, 7), (7, 7), (2, 7)]))
    decode = serve_prompt(server, _prompt(tokens, max_tokens=7), 8, stop, VOCAB, "s").decode
    served = ServedResults("s", 8, [decode], {}, BIN, "llama_cpp",
                           {"versions": {"llama.cpp": "version: 1"}}, counters_agree=False)
    text = format_table(_report_with_served(served, online))
    assert "served through llama.cpp, 1 prompts" in text
    assert "s: llama.cpp version: 1: drafts 2, accepted 9" in text
    assert "DIFFER FROM its Prometheus totals" in text


def _executable(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_llama_server_is_found_or_refused_saying_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.delenv(server_mod.SERVER_VARIABLE, raising=False)
    monkeypatch.setattr(server_mod, "DEFAULT_SERVER", tmp_path / "none" / "llama-server")
    with pytest.raises(EvalError) as e:
        find_llama_server(None)
    assert "scripts/llama_cpp_build.sh" in str(e.value) and "--llama-server" in str(e.value)
    with pytest.raises(EvalError, match="--llama-server /x/llama-server: no such file"):
        find_llama_server("/x/llama-server")
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(EvalError, match="not executable"):
        find_llama_server(str(plain))
    binary = _executable(tmp_path / "llama-server", "exit 0")
    monkeypatch.setenv(server_mod.SERVER_VARIABLE, binary)
    assert find_llama_server(None) == binary


def test_a_server_that_fails_to_load_is_one_error_quoting_its_log(tmp_path):
    binary = _executable(tmp_path / "llama-server",
                         "echo 'llama_model_load: error loading model: bad tensor'; exit 1")
    setup = ServerSetup(binary, "t.gguf", "d.gguf", 8, 64, 1, tmp_path / "server.log")
    with pytest.raises(EvalError) as e:
        with LlamaServer(setup):
            pass
    message = str(e.value)
    assert "exited with status 1" in message and "did not load t.gguf" in message
    assert "error loading model: bad tensor" in message


def _run_cli(*args):
    return CliRunner().invoke(eval_command, [str(a) for a in args])


def test_llama_cpp_options_are_checked_before_anything_runs(tmp_path, regen_store,
                                                            random_drafter_dir,
                                                            eos_target_dir, monkeypatch):
    binary = _executable(tmp_path / "llama-server", "exit 0")
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    cases = [
        (["--engine", "llama.cpp"], "--engine llama.cpp only applies to --served"),
        (["--llama-server", binary], "--llama-server only applies to --served"),
        (["--served", "--model", eos_target_dir, "--llama-server", binary],
         "--llama-server only applies to --served --engine llama.cpp"),
        (["--served", "--engine", "llama.cpp", "--model", eos_target_dir],
         f"--model {eos_target_dir}: llama-server serves a target .gguf file"),
        (["--served", "--engine", "llama.cpp", "--model", gguf, "--vllm-python", "/x/py"],
         "--vllm-python only applies to --served --engine vllm"),
        (["--served", "--engine", "llama.cpp", "--model", gguf, "--llama-server",
          tmp_path / "missing"], "no such file"),
    ]
    for options, message in cases:
        result = _run_cli("--store", regen_store, "--no-progress", *options, random_drafter_dir)
        assert result.exit_code == 1 and message in result.output, (options, result.output)
        assert "Traceback" not in result.output


FAKE_SERVER = Path(__file__).resolve().parents[1] / "reliability" / "fake_llama_server.py"
"""A stand-in llama-server; in its "serve" mode it answers as its docstring says."""


def test_llama_cpp_decodes_with_and_without_the_drafter_taking_turns_prompt_by_prompt(
        tmp_path, monkeypatch):
    binary = _executable(tmp_path / "llama-server",
                         f'exec {sys.executable} {FAKE_SERVER} "$@"')
    for name, value in (("MODE", "serve"), ("PID", tmp_path / "pid"),
                        ("ORDER", tmp_path / "order")):
        monkeypatch.setenv(f"FAKE_LLAMA_{name}", str(value))
    monkeypatch.setattr(llama_mod, "export_drafters",
                        lambda checkpoints, plan, workdir: {n: workdir / n for n in checkpoints})
    plan = llama_mod.LlamaPlan(binary, "1", "t.gguf", "ALL_F32", VOCAB, "float32", 1)
    prompts = [_prompt(PROMPT + [20], i, max_tokens=6) for i in range(4)]
    job = ServeJob({"s": ("ckpt", 8)}, prompts, StopRule([EOS_ID], 6, 100), 4, True,
                   lambda _: None)
    served = llama_mod.serve_llama(plan, job)["s"]
    # turns flip each prompt: neither server always answers first
    assert (tmp_path / "order").read_text().split() == ["drafter", "plain", "plain", "drafter",
                                                        "drafter", "plain", "plain", "drafter"]
    # asked for 6 + 8 tokens, 1 accepted draft a step: 7 steps each, 3 kept for 6 tokens
    assert all(r.committed == [2, 2, 1] and r.anchors == [3, 5, 7] for r in served.decodes)
    assert served.summary().to_json()["llama_cpp"]["counters_agree"]  # all 28 steps in /metrics
    assert [b["start"] for b in served.summary().to_json()["tau_by_position"]["bins"]] == [0, 4]
    speed = served.summary().to_json()["speed"]
    assert speed["prompts"] == speed["same_text"] == 4
    assert speed["with_drafter"]["decode_tokens"] == 4 * 13  # the whole generation, uncut
    assert speed["with_drafter"]["rounds"] == 4 * 7
    assert speed["with_drafter"]["ms_per_round"] == pytest.approx(30)
    assert speed["without_drafter"]["ms_per_token"] == pytest.approx(10)
    assert speed["break_even_tau"] == pytest.approx(3)
    assert speed["speedup"] == pytest.approx((13 / 7) / 3)
    assert speed["concurrency"] == "one prompt at a time"
    assert "timings.predicted_ms" in speed["timing"]


def test_a_decode_time_that_is_not_a_time_is_refused_naming_the_prompt():
    with pytest.raises(EvalError, match=r"prompt 0/0: timings.predicted_ms is -3.0, not a "
                                        r"finite time >= 0"):
        parse_completion(answer([20, 21], predicted_ms=-3.0), 3, VOCAB, WHERE)
    assert parse_completion(answer([20, 21], predicted_ms=250.0), 3, VOCAB,
                            WHERE).decode_seconds == 0.25
