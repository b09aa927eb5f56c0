"""eval --served --engine llama.cpp for real: llama-server (scripts/llama_cpp_build.sh) serves a
tiny Llama GGUF target written here in float32, with a drafter trained here and exported by
`dflash export --format gguf`; its rounds must equal `--online` and offline replay, prompt by
prompt and round by round. Skipped, saying how to build llama-server, without it; `pytest -m
llama_cpp` runs these alone.

float32 weights because llama.cpp multiplies Q8_0 weights by Q8_0-rounded activations, which
transformers (our --online, on the dequantized weights) does not: greedy would flip on near
ties and the equality would test rounding, not the drafter.
"""

import os

import pytest
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.evaluate.engines.llama_server import LlamaServer, ServerSetup, find_llama_server
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from tests.evaluate.conftest import fit_drafter, random_drafter, regenerated_store
from tests.extract.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.llama_cpp

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llama_server():
    try:
        return find_llama_server(os.environ.get("DFLASH_LLAMA_SERVER"))
    except EvalError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("llama_f32") / "tiny-llama.F32.gguf",
                           matrices="F32")


@pytest.fixture(scope="module")
def store(tmp_path_factory, target_gguf):
    return regenerated_store(tmp_path_factory, "served_llama", target_gguf, 8, NEW_TOKENS)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, store):
    from dflash_train.drafter import save_drafter

    # 60 steps: streaks of every length 0..7 on this store (20 gives only 0 and 1)
    model = fit_drafter(random_drafter(seed=1), store, steps=60)
    return str(save_drafter(model, tmp_path_factory.mktemp("served_llama_drafter") / "d60"))


def test_llama_server_loads_a_dflash_export_and_drafts_with_it(llama_server, target_gguf,
                                                               drafter_dir, tmp_path):
    out = tmp_path / "d60.gguf"
    exported = CliRunner().invoke(main, ["export", drafter_dir, str(out), "--format", "gguf",
                                         "--target-gguf", target_gguf, "--dtype", "float32"])
    assert exported.exit_code == 0, exported.output
    setup = ServerSetup(llama_server, target_gguf, str(out), 8, 256, 1, tmp_path / "log")
    with LlamaServer(setup) as server:
        assert "llamacpp:spec_decode_num_drafts_total" in server.metrics()
    log = (tmp_path / "log").read_text()
    assert "adding speculative implementation 'draft-dflash'" in log
    assert "block_size=8, mask_token_id=4, n_extract=3" in log


def test_served_rounds_equal_online_and_offline_prompt_by_prompt(llama_server, target_gguf,
                                                                 store, drafter_dir, tmp_path):
    out = run_eval(EvalConfig(store=store, checkpoints=[drafter_dir], online=True,
                              served=True, engine="llama.cpp", model=target_gguf,
                              llama_server=llama_server, progress=False,
                              out=str(tmp_path / "eval")),
                   echo=lambda line: None)
    served, online, offline = out.served["d60"], out.online["d60"], out.offline["d60"]
    assert len(served.decodes) == 8
    for decode in served.decodes:  # the store's text (and so --online's) ...
        assert decode.tokens == out.generated[decode.prompt.sample.key]
    # ... and the same rounds: anchors and committed tokens, prompt by prompt.
    assert served.walks[None].rounds == online.walks[None].rounds == offline.walks[None].rounds
    mine, theirs = served.summary().to_json(), online.summary().to_json()
    for key in ("n_blocks", "mean_tau", "streak_hist", "cond_accept"):
        assert mine[key] == theirs[key], key
    assert sum(n > 0 for n in theirs["streak_hist"]) >= 3, "acceptance too uniform to test"
    counts = mine["llama_cpp"]
    assert counts["counters_agree"], counts  # log steps == answers == /metrics
    assert counts["num_drafts"] == theirs["n_blocks"]
    check = out.report["served_check"]["checkpoints"]["d60"]
    assert check["first_difference"] is None
    assert check["same_text"] == check["same_taus_as_offline"] == 8
    assert "served through llama.cpp" in out.text and "d60 (served)" in out.text
    # llama-server decoded the prompts without the drafter too, taking turns with it
    speed = mine["speed"]
    assert speed["prompts"] == 8 and 0 <= speed["same_text"] <= 8
    for side in ("with_drafter", "without_drafter"):
        for key in ("decode_tokens", "decode_seconds", "tokens_per_s", "ms_per_token"):
            assert speed[side][key] > 0, (side, key)
    assert speed["with_drafter"]["rounds"] > 0
    assert speed["speedup"] > 0 and speed["break_even_tau"] > 0
    assert "break-even" in out.text


def _served_equals_online(llama_server, target_gguf, store, drafter, tmp_path) -> dict:
    """Serve one drafter directory beside --online; the online summary, once both agree
    round by round and llama-server's counters agree with themselves."""
    name = os.path.basename(drafter)
    out = run_eval(EvalConfig(store=store, checkpoints=[drafter], online=True, served=True,
                              engine="llama.cpp", model=target_gguf, speed=False,
                              llama_server=llama_server, progress=False),
                   echo=lambda line: None)
    served, online, offline = out.served[name], out.online[name], out.offline[name]
    assert out.report["served_check"]["checkpoints"][name]["first_difference"] is None
    assert served.walks[None].rounds == online.walks[None].rounds == offline.walks[None].rounds
    assert served.summary().to_json()["llama_cpp"]["counters_agree"]
    return online.summary().to_json()


def test_a_draft_vocabulary_drafter_is_served_as_it_replays(llama_server, target_gguf, store,
                                                             tmp_path):
    # llama.cpp loads d2t (target ids) and the drafter's own output rows: the same drafts as
    # offline replay and --online, labels off the map missed everywhere.
    from dflash_train.assets.tiny import VOCAB_SIZE
    from dflash_train.drafter import save_drafter
    from tests.evaluate.conftest import mapped_drafter

    model = fit_drafter(mapped_drafter(store, VOCAB_SIZE // 2, seed=1), store, steps=60)
    online = _served_equals_online(llama_server, target_gguf, store,
                                   str(save_drafter(model, tmp_path / "mapped")), tmp_path)
    assert sum(n > 0 for n in online["streak_hist"]) >= 3, "too uniform to test"


def test_a_dflash2_drafter_is_served_as_it_replays(llama_server, target_gguf, store,
                                                   tmp_path):
    # The selector walk (llama.cpp's h_nextn lattice) must pick the candidates ours picks:
    # the backbone is fitted, the selector's codebooks random, so the walk changes drafts.
    import torch

    from dflash_train.drafter import save_drafter

    model = fit_drafter(random_drafter(seed=3, kind="dflash2", conv_kernel_size=2,
                                       conv_group_size=16, selector_rank=8,
                                       selector_top_k=5), store, steps=60)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.candidate_selector.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    online = _served_equals_online(llama_server, target_gguf, store,
                                   str(save_drafter(model, tmp_path / "walk")), tmp_path)
    assert sum(n > 0 for n in online["streak_hist"]) >= 3, "too uniform to test"
