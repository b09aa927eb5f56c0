"""`eval --online` on a store a server sampled (extract --server --temperature): the server's
draws are not our keyed ones, so live decoding commits other text; eval says so and checks
the law instead (live against offline mean tau with 95 % intervals, chain and trees), never
claiming rounds equal."""

import pytest

from dflash_train.assets.tiny import make_chats, write_jsonl
from dflash_train.drafter import save_drafter
from dflash_train.evaluate.agreement import TEXT_NOT_CHECKED
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from dflash_train.store_schema import open_store
from dflash_train.target_model.sampling import SamplingConfig
from tests.evaluate.conftest import LAYERS, fit_drafter, random_drafter
from tests.extract.conftest import run_extract_cfg
from tests.extract.test_server_sampled import SamplingVllm

NEW_TOKENS = 24
SAMPLING = SamplingConfig(temperature=1.0, top_k=8, seed=5)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory, eos_target_dir):
    """(store a fake server sampled, a drafter fitted on it)."""
    tmp = tmp_path_factory.mktemp("server_drawn")
    data = write_jsonl(tmp / "chats.jsonl", make_chats(8))
    store = str(tmp / "store.zarr")
    server = SamplingVllm(eos_target_dir)
    try:
        run_extract_cfg(eos_target_dir, data, store, regenerate=True, max_new_tokens=NEW_TOKENS,
                        layers=",".join(map(str, LAYERS)), sampling=SAMPLING,
                        servers=[server.url])
    finally:
        server.close()
    drafter = str(save_drafter(fit_drafter(random_drafter(seed=1), store, steps=25),
                               tmp / "drafter"))
    return store, drafter


def _taus(walk) -> list[int]:
    return [t for rounds in walk.rounds.values() for _, t in rounds]


def test_online_on_a_server_drawn_store_checks_the_law_not_the_rounds(drawn, eos_target_dir):
    store, drafter = drawn
    lines: list[str] = []
    out = run_eval(EvalConfig(store=store, checkpoints=[drafter], online=True,
                              model=eos_target_dir, progress=False,
                              settings=EvalSettings(mode="replay", tree_budgets=(8,))),
                   echo=lines.append)
    name = "drafter"
    check = out.report["online_check"]
    assert check["drawn_by"] == "server" and check["text"] == TEXT_NOT_CHECKED
    assert "same_text" not in check and "same_taus" not in check
    stored = {s.source_row: s.input_ids.tolist()
              for p in open_store(store).parts() for s in p.iter_samples()}
    assert check["prompts"] == len(stored)
    entry = check["checkpoints"][name]
    for budget, tau in ((None, entry["tau_check"]), (8, entry["tree_tau_checks"]["8"])):
        live, offline = _taus(out.online[name].walks[budget]), _taus(
            out.offline[name].walks[budget])
        assert tau["online"]["rounds"] == len(live) > 1
        assert tau["online"]["mean_tau"] == pytest.approx(sum(live) / len(live))
        # --mode replay: offline's walk is its own rounds, all within the live cap here
        assert tau["offline"]["rounds"] == len(offline)
        assert tau["offline"]["mean_tau"] == pytest.approx(sum(offline) / len(offline))
        lo, hi = tau["online"]["tau_ci95"]
        assert lo <= tau["online"]["mean_tau"] <= hi
        assert isinstance(tau["within"], bool)
    # the live text is another sample: rounds could not have been compared
    assert any(out.online[name].walks[None].rounds[k] != out.offline[name].walks[None].rounds[k]
               for k in out.online[name].walks[None].rounds)
    assert out.report["drawn_by"] == "server"
    assert "sampled by a server" in out.text and "in-distribution only" in out.text
    assert "drawn by a server" in out.text and "generated text equals" not in out.text
    assert any("compared with offline's as a distribution" in line for line in lines)
