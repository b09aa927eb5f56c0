"""eval --served on a sampled store (extract --regenerate --temperature), with the stand-in
engines: every request carries the store's temperature, top-p and top-k and a seed of its own
(vLLM's SamplingParams; llama-server's body, with its samplers in our order); the served check
compares mean tau of the chain with offline's on the same prompts instead of text; a greedy
store's requests and check are as they were; --temperature must be the store's."""

import json
import sys
import tempfile
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_train.assets.tiny import make_chats, write_jsonl
from dflash_train.drafter import save_drafter
from dflash_train.evaluate.agreement import TEXT_NOT_CHECKED
from dflash_train.evaluate.command import eval_command
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.engines import llama_cpp as llama_mod
from dflash_train.evaluate.engines import vllm as vllm_mod
from dflash_train.evaluate.engines.llama_cpp import SAMPLED_CHAIN, request_body
from dflash_train.evaluate.engines.shared import (
    ServedResults,
    ServeJob,
    served_decode,
    served_tau_check,
)
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.online import StopRule
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from dflash_train.store_schema import open_store
from dflash_train.target_model.sampling import GREEDY, SEED_LIMIT, SamplingConfig
from tests.evaluate.conftest import EOS_ID, LAYERS, fit_drafter, random_drafter
from tests.evaluate.test_online import PROMPT
from tests.evaluate.test_served import BIN, FAKE_VLLM, _fake_python, _prompt, _raw
from tests.evaluate.test_served_llama_parsing import FAKE_SERVER, VOCAB, _executable
from tests.extract.conftest import run_extract_cfg

NEW_TOKENS = 24
SAMPLING = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, seed=11)

RECORDING_VLLM = f'''
import json, os
exec(open({str(FAKE_VLLM / "vllm" / "__init__.py")!r}).read())
_Plain = SamplingParams


class SamplingParams(_Plain):
    def __init__(self, **kwargs):
        with open(os.environ["FAKE_VLLM_PARAMS"], "a") as f:
            f.write(json.dumps({{k: v for k, v in kwargs.items()
                                if k not in ("stop_token_ids", "detokenize")}}) + "\\n")
        super().__init__(**kwargs)
'''
"""tests/evaluate/fake_vllm's `vllm`, noting each SamplingParams' fields in
$FAKE_VLLM_PARAMS (a JSON line each)."""


@pytest.fixture(scope="module")
def sampled(tmp_path_factory, eos_target_dir):
    """(sampled store, a drafter fitted on it): fitted a few steps so that tau varies."""
    tmp = tmp_path_factory.mktemp("served-sampled")
    data = write_jsonl(tmp / "chats.jsonl", make_chats(8))
    store = str(tmp / "store.zarr")
    run_extract_cfg(eos_target_dir, data, store, regenerate=True, max_new_tokens=NEW_TOKENS,
                    layers=",".join(map(str, LAYERS)), sampling=SAMPLING)
    drafter = str(save_drafter(fit_drafter(random_drafter(seed=1), store, steps=25),
                               tmp / "drafter"))
    return store, drafter


@pytest.fixture
def recording_vllm(tmp_path, monkeypatch):
    """(a VllmPython whose `vllm` notes every SamplingParams, the file it notes them in);
    checkpoints are not exported (the stand-in never reads them)."""
    package = tmp_path / "recording" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(RECORDING_VLLM)
    (package / "inputs.py").write_text((FAKE_VLLM / "vllm" / "inputs.py").read_text())
    # a CUDA build as its probe tells (a CPU build of vLLM is refused at T > 0)
    probe = json.dumps({"vllm": "fake", "torch": "2.13.0+cu130"})
    python = _fake_python(tmp_path, f"if [ \"$1\" = -c ]; then echo '{probe}'; exit 0; fi\n"
                                    f'PYTHONPATH={package.parent} exec {sys.executable} "$@"')
    params = tmp_path / "params.jsonl"
    monkeypatch.setenv("FAKE_VLLM_PARAMS", str(params))
    monkeypatch.setattr(vllm_mod, "export_for_serving",
                        lambda paths, dtype, workdir: {n: workdir / n for n in paths})
    return python, params


def _noted(params: Path) -> list[dict]:
    return [json.loads(line) for line in params.read_text().splitlines()]


def _served_eval(store: str, drafter: str, target: str, python: str, **options):
    cfg = EvalConfig(store=store, checkpoints=[drafter], served=True, model=target,
                     vllm_python=python, speed=False, progress=False, **options)
    return run_eval(cfg, echo=lambda _: None)


def request_seed(sampling: SamplingConfig, prompt) -> int:
    from dflash_train.target_model.sampling import request_seed as seed

    return seed(sampling.seed, prompt.sample.source_row)


def test_a_request_seed_is_fixed_by_the_stores_seed_and_the_source_row():
    a, b = _prompt(PROMPT + [20], index=0), _prompt(PROMPT + [20], index=1)
    seeds = {request_seed(SAMPLING, p) for p in (a, b)}
    assert len(seeds) == 2 and all(0 <= s < SEED_LIMIT for s in seeds)
    assert request_seed(SAMPLING, a) == request_seed(SAMPLING, _prompt(PROMPT + [30], index=0))
    other = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, seed=12)
    assert request_seed(other, a) != request_seed(SAMPLING, a)


def test_tau_check_walks_offline_as_the_engine_did_and_says_whether_intervals_meet():
    tokens = PROMPT + list(range(20, 30))
    decode = served_decode(_prompt(tokens), _raw(tokens[len(PROMPT):], [1, 2, 0, 3], 4), 4, "vLLM")
    served = ServedResults("s", 4, [decode], {}, BIN, "vllm")
    rounds = list(zip(decode.anchors, decode.committed, strict=True))  # (3, 2) (5, 3) (8, 1) (9, 3)
    # offline under --mode all: a tau at every anchor, the walk visits 3, 5, 8, 9
    every = {a: 4 for a in range(3, 12)} | dict(rounds)
    offline = _offline({(0, 0): sorted(every.items())})
    same = served_tau_check(served, offline)
    assert same["served"] == same["offline"] and same["offline"]["rounds"] == 4
    assert same["within"] is True
    worse = _offline({(0, 0): [(3, 1), (4, 1), (5, 1), (6, 1), (7, 1),
                               (8, 1), (9, 1), (10, 1), (11, 1)]})
    assert served_tau_check(served, worse)["within"] is False
    one = _offline({(0, 0): [(3, 2)]})  # its walk ends at anchor 5
    assert served_tau_check(served, one)["offline"]["rounds"] == 1
    assert served_tau_check(served, one)["within"] is None


def test_vllm_samples_every_prompt_with_the_stores_settings_and_its_own_seed(
        sampled, eos_target_dir, recording_vllm):
    store, drafter = sampled
    python, params = recording_vllm
    out = _served_eval(store, drafter, eos_target_dir, python)
    decodes = out.served[Path(drafter).name].decodes
    noted = _noted(params)
    assert [p["max_tokens"] for p in noted] == [r.prompt.max_tokens for r in decodes]
    for p, r in zip(noted, decodes, strict=True):
        assert (p["temperature"], p["top_p"], p["top_k"]) == (0.7, 0.9, 20)
        assert p["seed"] == request_seed(SAMPLING, r.prompt)
    assert len({p["seed"] for p in noted}) == len(noted)


def test_the_sampled_served_check_compares_mean_tau_not_text(sampled, eos_target_dir,
                                                             recording_vllm):
    store, drafter = sampled
    out = _served_eval(store, drafter, eos_target_dir, recording_vllm[0])
    check = out.report["served_check"]
    assert check["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 11}
    assert check["text"] == TEXT_NOT_CHECKED and check["against"] == "offline"
    name = Path(drafter).name
    entry = check["checkpoints"][name]
    assert list(entry) == ["tau_check"]  # no same_text, no first difference
    tau = entry["tau_check"]
    offline = out.report["checkpoints"][0]["offline"]
    served = out.report["checkpoints"][0]["served"]
    # the same prompts, every token the engine may generate: offline's whole chain
    assert (tau["offline"]["rounds"], tau["offline"]["mean_tau"], tau["offline"]["tau_ci95"]) \
        == (offline["n_blocks"], offline["mean_tau"], offline["tau_ci95"])
    assert (tau["served"]["rounds"], tau["served"]["mean_tau"]) == \
        (served["n_blocks"], served["mean_tau"])
    (lo, hi), (olo, ohi) = tau["served"]["tau_ci95"], tau["offline"]["tau_ci95"]
    assert tau["within"] == (lo <= ohi and olo <= hi)
    verdict = "within" if tau["within"] else "outside"
    line = next(x for x in out.text.splitlines() if "served tau" in x)
    assert line.strip().startswith(f"served tau {tau['served']['mean_tau']:.3f} ({lo:.3f}-"
                                   f"{hi:.3f}) vs offline {offline['mean_tau']:.3f} ")
    assert f": {verdict} their intervals" in line
    assert "stored text" not in out.text and "first difference" not in out.text
    assert "served text and rounds not compared" in out.text


def test_offline_walks_the_same_chain_under_mode_all(sampled, eos_target_dir, recording_vllm):
    # --mode all drafts at every anchor; the check walks live decoding's chain through them
    store, drafter = sampled
    python = recording_vllm[0]
    replay = _served_eval(store, drafter, eos_target_dir, python)
    every = _served_eval(store, drafter, eos_target_dir, python,
                         settings=EvalSettings(mode="all"))
    name = Path(drafter).name
    tau = [o.report["served_check"]["checkpoints"][name]["tau_check"]["offline"]
           for o in (replay, every)]
    assert tau[0] == tau[1]
    assert every.report["checkpoints"][0]["offline"]["n_blocks"] > tau[1]["rounds"]


def test_a_greedy_store_is_served_and_checked_as_before(regen_store, eos_target_dir,
                                                        random_drafter_dir, recording_vllm):
    python, params = recording_vllm
    out = _served_eval(regen_store, random_drafter_dir, eos_target_dir, python)
    assert all(p == {"max_tokens": p["max_tokens"], "temperature": 0.0}
               for p in _noted(params))
    check = out.report["served_check"]
    assert "sampling" not in check and "text" not in check
    entry = check["checkpoints"][Path(random_drafter_dir).name]
    assert {"same_text", "first_difference", "likely_causes"} <= set(entry)
    assert "served tau" not in out.text
    stop = StopRule([EOS_ID], 8, 64)
    request = vllm_mod.build_request("t", "d", 4, [_prompt(PROMPT + [20])], stop, "float32",
                                     None, GREEDY)
    assert "sampling" not in request and list(request["prompts"][0]) == ["key", "ids",
                                                                         "max_tokens"]


def test_llama_cpp_samples_in_our_order_with_the_stores_settings_and_a_seed(tmp_path,
                                                                            monkeypatch):
    prompt = _prompt(PROMPT + [20])
    greedy = request_body(prompt, 8)
    assert greedy == {"prompt": PROMPT, "n_predict": 108, "temperature": 0.0,
                      "samplers": ["temperature"], "cache_prompt": False,
                      "return_tokens": True, "stream": False, "seed": 0}
    assert request_body(prompt, 8, GREEDY) == greedy
    body = request_body(prompt, 8, SAMPLING)
    assert SAMPLED_CHAIN == ["top_k", "temperature", "top_p"]  # top-p after the temperature
    assert {k: v for k, v in body.items() if greedy.get(k) != v} == {
        "temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.0,
        "samplers": SAMPLED_CHAIN, "seed": request_seed(SAMPLING, prompt)}
    # through the stand-in llama-server, with and without the drafter: every request samples
    binary = _executable(tmp_path / "llama-server", f'exec {sys.executable} {FAKE_SERVER} "$@"')
    monkeypatch.setenv("FAKE_LLAMA_MODE", "serve")
    monkeypatch.setenv("FAKE_LLAMA_PID", str(tmp_path / "pid"))
    monkeypatch.setattr(llama_mod, "export_drafters",
                        lambda checkpoints, plan, workdir: {n: workdir / n for n in checkpoints})
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bodies = []
    complete = llama_mod.LlamaServer.complete

    def noting(server, body, what="a prompt"):
        bodies.append(body)
        return complete(server, body, what)

    monkeypatch.setattr(llama_mod.LlamaServer, "complete", noting)
    plan = llama_mod.LlamaPlan(binary, "1", "t.gguf", "ALL_F32", VOCAB, "float32", 1)
    prompts = [_prompt(PROMPT + [20], i, max_tokens=6) for i in range(3)]
    job = ServeJob({"s": ("ckpt", 8)}, prompts, StopRule([EOS_ID], 6, 100), 4, True,
                   lambda _: None, SAMPLING)
    llama_mod.serve_llama(plan, job)
    assert len(bodies) == 6
    assert sorted(json.dumps(b, sort_keys=True) for b in bodies) == sorted(
        json.dumps(request_body(p, 8, SAMPLING), sort_keys=True) for p in prompts * 2)


def _run_cli(*args):
    return CliRunner().invoke(eval_command, [str(a) for a in args])


def test_a_temperature_other_than_the_stores_is_refused_naming_both(sampled, regen_store,
                                                                     random_drafter_dir):
    store, drafter = sampled
    result = _run_cli("--store", store, "--temperature", "1.0", "--no-progress", drafter)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "--temperature 1.0, but the store's answers were drawn at temperature 0.7" \
        in result.output
    result = _run_cli("--store", regen_store, "--temperature", "0.5", "--no-progress",
                      random_drafter_dir)
    assert result.exit_code == 1
    assert "--temperature 0.5, but the store's answers were drawn greedily" in result.output
    assert _run_cli("--store", store, "--temperature", "0.7", "--no-progress", "--limit", "2",
                    drafter).exit_code == 0
    assert _run_cli("--store", regen_store, "--temperature", "0", "--no-progress", "--limit",
                    "2", random_drafter_dir).exit_code == 0
    assert open_store(store).meta.sampling["temperature"] == 0.7



def test_vllm_cpu_is_refused_at_t_above_0_and_kept_at_t_0():
    cpu = vllm_mod.VllmPython("/v/python", "0.32.0", "2.13.0+cpu")
    with pytest.raises(EvalError, match=r"vLLM 0.32.0 on CPU \(torch 2.13.0\+cpu, /v/python\) "
                                        "cannot verify drafts at T > 0"):
        vllm_mod.check_sampling(cpu, SAMPLING)
    vllm_mod.check_sampling(cpu, GREEDY)
    vllm_mod.check_sampling(vllm_mod.VllmPython("/v/python", "0.32.0", "2.13.0+cu130"),
                            SAMPLING)


def _real_vllm():
    try:
        return vllm_mod.find_vllm(None)
    except EvalError as e:
        pytest.skip(str(e))


@pytest.mark.vllm
def test_a_cpu_build_of_vllm_is_refused_on_a_sampled_store(sampled, eos_target_dir):
    """vllm-cpu 0.32.0's rejection sampler leaves each request's temperature, top-k and top-p
    unset (engines/vllm.py check_sampling): refused before anything loads."""
    python = _real_vllm()
    if "+cpu" not in python.torch:
        pytest.skip(f"vLLM here runs on torch {python.torch}, not a CPU build")
    store, drafter = sampled
    with pytest.raises(EvalError, match=r"vLLM 0\.\d+\.\d+ on CPU .* cannot verify drafts at "
                                        r"T > 0.*--engine llama.cpp"):
        _served_eval(store, drafter, eos_target_dir, python.path)


@pytest.mark.vllm
def test_real_vllm_samples_reproducibly_and_its_tau_agrees_with_offline(tmp_path_factory):
    """A vLLM build that samples speculative drafts (not vllm-cpu 0.32.0): a sampled store of
    test_served_vllm's target, served twice: the same seeds draw the same texts, not the
    stored ones, and the served chain's mean tau meets offline's interval."""
    from tests.evaluate.conftest import save_eos_target
    from tests.evaluate.test_served_vllm import HEADS

    python = _real_vllm()
    if "+cpu" in python.torch:
        pytest.skip(f"vLLM on torch {python.torch} is refused at T > 0 (check_sampling)")
    tmp = tmp_path_factory.mktemp("served-sampled-vllm")
    target = save_eos_target(tmp / "target", **HEADS)
    store = str(tmp / "store.zarr")
    run_extract_cfg(target, write_jsonl(tmp / "chats.jsonl", make_chats(8)), store,
                    regenerate=True, max_new_tokens=NEW_TOKENS,
                    layers=",".join(map(str, LAYERS)), sampling=SAMPLING)
    drafter = str(save_drafter(fit_drafter(random_drafter(seed=1, **HEADS), store, steps=20),
                               tmp / "d20"))
    first, again = (_served_eval(store, drafter, target, python.path) for _ in range(2))
    texts = [{r.prompt.key: r.tokens for r in o.served["d20"].decodes} for o in (first, again)]
    assert texts[0] == texts[1]
    stored = {f"{k[0]}/{k[1]}": t for k, t in first.runs["offline"].decoded["d20"].text.items()}
    assert sum(t != stored[k] for k, t in texts[0].items()) >= 4
    tau = first.report["served_check"]["checkpoints"]["d20"]["tau_check"]
    assert tau["within"], tau
    assert first.report["checkpoints"][0]["served"]["vllm"]["counters_agree"]


def _offline(rounds: dict) -> types.SimpleNamespace:
    """Offline results as tau_check reads them: the chain's rounds per sample."""
    return types.SimpleNamespace(walks={None: types.SimpleNamespace(rounds=rounds)})
