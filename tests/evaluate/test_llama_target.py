"""A Llama-architecture target read from a GGUF file, through every stage: extract
--regenerate -> train (the drafter sized from the store) -> eval offline and --online ->
export; offline replay equals live speculative decoding prompt by prompt."""

import json

import pytest
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from dflash_train.store_schema import open_store
from tests.evaluate.conftest import fitted_drafter_dir, regenerated_store
from tests.extract.tiny_gguf import LLAMA, write_tiny_gguf


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> str:
    return write_tiny_gguf(tmp_path_factory.mktemp("llama") / "tiny-llama.Q8_0.gguf")


@pytest.fixture(scope="module")
def llama_store(tmp_path_factory, llama_gguf) -> str:
    return regenerated_store(tmp_path_factory, "llama", llama_gguf, 10, 24)


def test_llama_gguf_target_through_extract_train_eval_and_export(llama_store, llama_gguf,
                                                                tmp_path_factory, tmp_path):
    store = open_store(llama_store)
    assert store.meta.target.model_type == "llama" and store.meta.source.regenerated
    assert store.meta.target.revision.startswith("gguf-sha256:")

    run = tmp_path / "run"
    trained = CliRunner().invoke(main, [
        "train", "--store", llama_store, "--out", str(run), "--layers", "2", "--no-progress",
        "--set", "optim.epochs=3", "--set", "loader.batch_tokens=256",
        "--anchors-per-seq", "8", "--device", "cpu"])
    assert trained.exit_code == 0, trained.output
    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]
    drafter = json.loads((checkpoint / "drafter" / "config.json").read_text())
    # the target's own grouped-query heads, width, MLP and RoPE base; the store's mask token
    assert (drafter["num_attention_heads"], drafter["num_key_value_heads"],
            drafter["head_dim"]) == (4, 2, 16)
    assert drafter["hidden_size"] == 64 and drafter["intermediate_size"] == 128
    assert drafter["rope_theta"] == LLAMA["rope_theta"]
    mask = store.meta.extra["mask_token_id"]
    assert drafter["dflash_config"]["mask_token_id"] == mask < LLAMA["vocab_size"]

    # a drafter fitted to the store gives streaks of many lengths: the equality has teeth
    fitted = fitted_drafter_dir(tmp_path_factory, llama_store, 40, "llama_fitted")
    cfg = EvalConfig(store=llama_store, checkpoints=[str(checkpoint), fitted], device="cpu",
                     settings=EvalSettings(mode="replay", tree_budgets=(8,)), online=True,
                     model=llama_gguf, progress=False)
    out = run_eval(cfg)
    check = out.report["online_check"]
    assert check["same_text"] == check["prompts"] == store.num_samples
    for name in out.offline:
        assert out.offline[name].walks[None].rounds == out.online[name].walks[None].rounds, name
        assert out.offline[name].summary().to_json() == out.online[name].summary().to_json(), name
    taus = [t for seq in out.online["llama_fitted"].walks[None].rounds.values() for _, t in seq]
    assert len(set(taus)) >= 4

    exported = CliRunner().invoke(main, ["export", str(checkpoint), str(tmp_path / "export")])
    assert exported.exit_code == 0, exported.output
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["num_attention_heads"] == 4 and config["dflash_config"]["mask_token_id"] == mask
