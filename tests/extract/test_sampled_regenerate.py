"""--regenerate --temperature T stores the target's own keyed draws: the same answers in any
batching and for the same seed, other answers for another seed, the settings in provenance."""

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import (
    build_tokenizer,
    cli_args,
    make_chats,
    run_cli,
    run_extract_cfg,
    store_samples,
    write_jsonl,
)
from transformers import AutoModelForCausalLM

from dflash_train.cli import main
from dflash_train.extract.data import to_chat
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.render import render_prompt
from dflash_train.store_schema import open_store, validate
from dflash_train.store_schema.info import answers_description
from dflash_train.target_model.generation import continuations
from dflash_train.target_model.sampling import SamplingConfig, sample_next

NEW = 8
SETTINGS = [SamplingConfig(temperature=0.7, top_p=0.9, seed=3),
            SamplingConfig(temperature=1.0, top_k=5, seed=4),
            SamplingConfig(temperature=1.0, seed=5)]


def _drawn(model, prompt: list[int], row: int, cfg: SamplingConfig, eos: int) -> list[int]:
    """One prompt alone, no cache, no padding: the independent expectation of its draws."""
    ids = list(prompt)
    for _ in range(NEW):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[:, -1]
        nxt = int(sample_next(logits, cfg, [row], [len(ids)])[0])
        ids.append(nxt)
        if nxt == eos:
            break
    return ids[len(prompt):]


def _prompts(chats_jsonl: str) -> list[list[int]]:
    tokenizer = build_tokenizer()
    rows = [json.loads(line) for line in open(chats_jsonl) if line.strip()]
    return [render_prompt(tokenizer, to_chat(r, "row"), thinking=False, where="row")
            for r in rows]


@pytest.mark.parametrize("model_fixture", ["qwen3_dir", "qwen3_5_dir"])
@pytest.mark.parametrize("cfg", SETTINGS, ids=["t0.7-top_p0.9", "t1-top_k5", "t1"])
def test_batched_draws_equal_one_prompt_at_a_time(model_fixture, cfg, chats_jsonl, request):
    model_dir = request.getfixturevalue(model_fixture)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(chats_jsonl)[:6]
    rows = [10, 11, 12, 13, 14, 15]
    eos = build_tokenizer().eos_token_id
    batched = continuations(model, prompts, max_new_tokens=NEW, eos_ids=[eos], pad_id=0,
                            sampling=cfg, sample_ids=rows)
    alone = [_drawn(model, p, r, cfg, eos) for p, r in zip(prompts, rows, strict=True)]
    assert batched == alone
    # in another order and split, each prompt still draws its own answer
    flipped = continuations(model, prompts[::-1][:3], max_new_tokens=NEW, eos_ids=[eos],
                            pad_id=0, sampling=cfg, sample_ids=rows[::-1][:3])
    assert flipped == alone[::-1][:3]
    if cfg.top_k == 0:  # sampled answers are not the greedy ones
        assert batched != continuations(model, prompts, max_new_tokens=NEW, eos_ids=[eos],
                                         pad_id=0)


@pytest.mark.parametrize("model_fixture", ["qwen3_dir", "qwen3_5_dir"])
def test_a_sampled_store_holds_each_rows_own_draws_whatever_the_batches(
        model_fixture, chats_jsonl, tmp_path, request):
    model_dir = request.getfixturevalue(model_fixture)
    cfg = SETTINGS[0]
    a, b = str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")
    run_extract_cfg(model_dir, chats_jsonl, a, regenerate=True, max_new_tokens=NEW,
                    sampling=cfg, batch_tokens=128)
    run_extract_cfg(model_dir, chats_jsonl, b, regenerate=True, max_new_tokens=NEW,
                    sampling=cfg, batch_tokens=40, rows_per_part=3)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = build_tokenizer().eos_token_id
    prompts = _prompts(chats_jsonl)
    for x, y in zip(store_samples(a), store_samples(b), strict=True):
        prompt = prompts[x.source_row]
        assert x.source_row == y.source_row
        assert x.input_ids.tolist() == y.input_ids.tolist() \
            == prompt + _drawn(model, prompt, x.source_row, cfg, eos)
    assert validate(a) == []


def test_the_seed_decides_the_answers_and_provenance_records_the_settings(qwen3_dir,
                                                                          chats_jsonl,
                                                                          tmp_path):
    stores = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        stores[name] = str(tmp_path / f"{name}.zarr")
        run_extract_cfg(qwen3_dir, chats_jsonl, stores[name], regenerate=True,
                        max_new_tokens=NEW, sampling=SamplingConfig(temperature=1.0, seed=seed))
    ids = {k: [s.input_ids.tolist() for s in store_samples(v)] for k, v in stores.items()}
    assert ids["a"] == ids["b"] != ids["c"]
    meta = open_store(stores["c"]).meta
    assert meta.sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 2}
    assert meta.extra["sampling"] == meta.sampling and meta.source.regenerated
    assert answers_description(meta) == ("the target's, sampled at temperature 1.0 (top-p "
                                         "off, top-k off) with seed 2")
    shown = CliRunner().invoke(main, ["store", "info", stores["c"]])
    assert shown.exit_code == 0, shown.output
    assert f"answers        {answers_description(meta)}" in shown.output
    assert "offline == live only where they do" not in shown.output


def test_a_greedy_store_records_no_sampling(qwen3_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_chats(3))
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(qwen3_dir, data, out, regenerate=True, max_new_tokens=3)
    meta = open_store(out).meta
    assert "sampling" not in meta.extra and meta.sampling is None
    assert answers_description(meta) == "the target's, greedy"


@pytest.mark.parametrize("other, named", [
    (SamplingConfig(temperature=1.0, seed=8), "extra.sampling.seed: 7 != 8"),
    (SamplingConfig(temperature=0.5, seed=7), "extra.sampling.temperature: 1.0 != 0.5"),
    (SamplingConfig(), "extra.sampling: {"),
])
def test_a_resume_with_other_sampling_settings_is_refused_naming_them(qwen3_dir, tmp_path,
                                                                      other, named):
    data = write_jsonl(tmp_path / "d.jsonl", make_chats(3))
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(qwen3_dir, data, out, regenerate=True, max_new_tokens=3,
                    sampling=SamplingConfig(temperature=1.0, seed=7))
    with pytest.raises(ExtractError, match=named.replace("{", r"\{")):
        run_extract_cfg(qwen3_dir, data, out, regenerate=True, max_new_tokens=3,
                        sampling=other)


@pytest.mark.parametrize("flags, named", [
    (["--temperature", "0.7"], "sampling options (--temperature 0.7) choose how answers are "
                               "generated: add --regenerate"),
    (["--seed", "3"], "sampling options (--seed 3) choose how"),
    (["--regenerate", "--top-p", "0.9"], "(--top-p 0.9) change nothing at --temperature 0"),
])
def test_sampling_options_that_cannot_apply_are_refused_in_one_line(qwen3_dir, tmp_path, flags,
                                                                    named):
    data = write_jsonl(tmp_path / "d.jsonl", make_chats(3))
    out = tmp_path / "hs.zarr"
    done = run_cli(cli_args(qwen3_dir, data, str(out)) + flags)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert named in done.stderr
    assert not out.exists()


def test_the_cli_options_reach_the_store(qwen3_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_chats(3))
    out = str(tmp_path / "hs.zarr")
    done = run_cli(cli_args(qwen3_dir, data, out) + [
        "--regenerate", "--max-new-tokens", "3", "--temperature", "0.7", "--top-p", "0.9",
        "--sample-top-k", "5", "--seed", "9"])
    assert done.returncode == 0, done.stderr
    assert open_store(out).meta.sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": 5,
                                             "seed": 9}
