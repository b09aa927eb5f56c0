"""The embedded default: a tiny target that is a real language model of stdlib code, its
prompt set, `dflash extract` without --data, and a shortened `dflash quickstart` whose
trained drafter beats the untrained one on held-out prompts."""

import json
import math
import platform

import pytest
import torch
from click.testing import CliRunner

from dflash_train.assets.embedded import prompt_file, target_dir
from dflash_train.assets.stdlib_corpus import (
    USER_PREFIX,
    list_sources,
    repeated_ngram_share,
    split_of,
)
from dflash_train.cli import main
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from dflash_train.extract.config import ExtractConfig
from dflash_train.extract.pipeline import with_default_data
from dflash_train.quickstart import (
    LOOP_FREE_SHARE,
    QuickstartConfig,
    run_quickstart,
)
from dflash_train.store_schema import open_store
from dflash_train.store_schema.subset import copy_store


def _rows(split: str) -> list[dict]:
    return [json.loads(line) for line in prompt_file(split).read_text().splitlines()]


def test_repeated_ngram_share_counts_4grams_seen_earlier_in_the_same_sequence():
    # 1 2 3 4 1 2 3 4 1: six 4-grams, the last two repeat the first two
    assert repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4, 1]) == (2, 6)
    assert repeated_ngram_share(list(range(10))) == (0, 7)
    assert repeated_ngram_share([7] * 6) == (2, 3)
    assert repeated_ngram_share([1, 2, 3]) == (0, 0)


def test_embedded_tokenizer_has_chat_template_eos_and_mask_token_the_model_can_embed():
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir())
    config = AutoConfig.from_pretrained(target_dir())
    assert tok.mask_token == "<|mask|>" and tok.eos_token == "<|im_end|>"
    assert tok.mask_token_id < config.vocab_size and len(tok) <= config.vocab_size
    text = tok.apply_chat_template([{"role": "user", "content": "x = 1"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nx = 1<|im_end|>\n<|im_start|>assistant\n"
    kinds = set(config.layer_types)
    assert kinds == {"linear_attention", "full_attention"}, "the target must be a hybrid"


@torch.no_grad()
def test_embedded_target_predicts_held_out_stdlib_code_far_better_than_uniform():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir())
    model = AutoModelForCausalLM.from_pretrained(target_dir(), dtype=torch.float32).eval()
    losses = []
    for row in _rows("held_out")[:16]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": row["prompt"]},
             {"role": "assistant", "content": row["response"]}], tokenize=False)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        losses.append(model(input_ids=ids, labels=ids).loss.item())
    uniform = math.log(model.config.vocab_size)
    assert sum(losses) / len(losses) < 0.5 * uniform


def test_prompt_sets_are_disjoint_coding_prompts_with_real_continuations():
    train, held = _rows("train"), _rows("held_out")
    assert len(train) >= 512 and len(held) >= 64
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(r["prompt"].startswith(USER_PREFIX) and r["response"].strip()
               for r in train + held)


def test_prompts_come_from_stdlib_files_the_target_never_trained_on():
    record = json.loads((target_dir() / "TRAINING.json").read_text())
    if record["python"] != platform.python_version():
        pytest.skip(f"the assets were built from Python {record['python']}'s stdlib")
    files = list_sources()
    for row in _rows("train")[:4] + _rows("held_out")[:4]:
        code = row["prompt"].removeprefix(USER_PREFIX) + "\n" + row["response"]
        homes = [f.name for f in files if code in f.text]
        assert homes and all(split_of(name) == "held_out" for name in homes), homes


def test_extract_without_data_uses_the_embedded_train_prompts_and_regenerates():
    cfg = with_default_data(ExtractConfig(model="m", data=[], out="o"), echo=lambda _: None)
    assert cfg.data == [str(prompt_file("train"))] and cfg.regenerate
    given = ExtractConfig(model="m", data=["chats.jsonl"], out="o")
    assert with_default_data(given, echo=lambda _: None) is given


def test_extract_dry_run_without_data_plans_every_embedded_prompt(tmp_path):
    result = CliRunner().invoke(main, ["extract", "--model", str(target_dir()), "--out",
                                       str(tmp_path / "hs.zarr"), "--device", "cpu",
                                       "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"samples: {len(_rows('train'))};" in result.output
    assert "implies --regenerate" in result.output


def test_quickstart_is_a_dflash_command():
    result = CliRunner().invoke(main, ["quickstart", "--help"])
    assert result.exit_code == 0 and "--out" in result.output


def test_shortened_quickstart_trains_a_drafter_that_beats_the_untrained_one(tmp_path):
    cfg = QuickstartConfig(out=str(tmp_path / "qs"), train_prompts=160, held_out_prompts=16,
                           max_new_tokens=48, epochs=12, batch_tokens=2048, progress=False)
    result = run_quickstart(cfg, echo=lambda _: None)
    untrained, trained = (c["offline"] for c in result.report["checkpoints"])
    assert [c["name"] for c in result.report["checkpoints"]][0] == "untrained"
    assert result.trained_tau > result.untrained_tau + 0.1, (result.untrained_tau,
                                                             result.trained_tau)
    # a clear margin: the 95 % intervals do not overlap
    assert trained["tau_ci95"][0] > untrained["tau_ci95"][1]
    assert trained["slot_accuracy"][0] > untrained["slot_accuracy"][0]
    assert (tmp_path / "qs" / "eval" / "report.json").is_file()
    # the gain is not only the target's loops: it holds on the answers that do not loop, and
    # that subset is exactly the held-out samples at or under the loop threshold
    free = result.loop_free
    assert free is not None and free["trained_tau"] > free["untrained_tau"], free
    held = open_store(str(tmp_path / "qs" / "held_out.zarr"))
    shares = []
    for part in held.parts():
        for s in part.iter_samples():
            repeated, total = repeated_ngram_share(s.input_ids[s.loss_mask].tolist())
            shares.append(repeated / max(1, total))
    assert free["of"] == len(shares) == 16
    assert free["samples"] == sum(share <= LOOP_FREE_SHARE for share in shares)
    # read from the eval's own rounds, it is what an eval of a store of only those reports
    def loop_free(s) -> bool:
        repeated, total = repeated_ngram_share(s.input_ids[s.loss_mask].tolist())
        return repeated / max(1, total) <= LOOP_FREE_SHARE

    subset = str(tmp_path / "loop_free.zarr")
    copy_store(str(tmp_path / "qs" / "held_out.zarr"), subset, keep=loop_free)
    checkpoints = [str(tmp_path / "qs" / "untrained"),
                   *map(str, (tmp_path / "qs" / "run" / "checkpoints").glob("step_*"))]
    alone = run_eval(EvalConfig(store=subset, checkpoints=checkpoints, device="cpu",
                                progress=False, out=str(tmp_path / "alone")),
                     echo=lambda _: None)
    untrained_alone, trained_alone = (c["offline"]["mean_tau"]
                                      for c in alone.report["checkpoints"])
    assert free["untrained_tau"] == pytest.approx(untrained_alone, abs=1e-12)
    assert free["trained_tau"] == pytest.approx(trained_alone, abs=1e-12)
