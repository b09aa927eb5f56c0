"""`extract --regenerate --server` against a real `vllm serve` (vLLM's OpenAI server from its
own venv, 127.0.0.1, a free port, killed in a finally) on the tiny head_dim-32 Qwen3 target:
the store equals the built-in one token for token, every served token is the extract
forward's top-1, and the store replays offline == `eval --online`. `pytest -m vllm` runs it."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import pytest
from conftest import assert_same_samples, make_chats, run_extract_cfg, store_samples, write_jsonl

from dflash_train.drafter import save_drafter
from dflash_train.evaluate.engines.vllm import clean_env
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from dflash_train.store_schema import open_store
from dflash_train.store_schema.info import top1_agreement
from tests.evaluate.conftest import LAYERS, fit_drafter, random_drafter, save_eos_target
from tests.evaluate.test_served_vllm import HEADS, NEW_TOKENS, vllm_python  # noqa: F401

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(url: str, server: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            pytest.fail(f"vllm serve exited {server.returncode}: {log.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if json.loads(r.read()).get("data"):
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vllm serve did not answer within {START_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_eos_target(tmp_path_factory.mktemp("regen_served_target"), **HEADS)


@pytest.fixture(scope="module")
def server_url(vllm_python, target_dir, tmp_path_factory):  # noqa: F811
    port = _free_port()
    env = {**clean_env(), "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(tmp_path_factory.mktemp("vllm_log") / "serve.log", "w+")
    server = subprocess.Popen(
        [vllm_python.path, "-m", "vllm.entrypoints.openai.api_server", "--model", target_dir,
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "512"], env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)  # its engine runs in child processes: kill the whole group
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_up(url, server, log)
        yield url
    finally:
        _stop(server)
        log.close()


def _stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(server.pid, signal.SIGKILL)  # whatever of the group outlived its leader
    except ProcessLookupError:
        pass
    server.wait(timeout=30)


def test_a_store_regenerated_by_vllm_serve_replays_offline_equal_to_online(
        target_dir, server_url, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", make_chats(8))
    served, builtin = str(tmp_path / "served.zarr"), str(tmp_path / "builtin.zarr")
    layers = ",".join(map(str, LAYERS))
    for out, servers in ((served, [server_url]), (builtin, [])):
        run_extract_cfg(target_dir, data, out, regenerate=True, max_new_tokens=NEW_TOKENS,
                        layers=layers, servers=servers, capture="forward")
    assert_same_samples(store_samples(served), store_samples(builtin))
    agree, answers = top1_agreement(open_store(served))
    assert answers > 8 and agree == answers  # fp32 on both sides

    drafter = fit_drafter(random_drafter(seed=1, **HEADS), served, steps=20)
    path = str(save_drafter(drafter, tmp_path / "d20"))
    out = run_eval(EvalConfig(store=served, checkpoints=[path], online=True, model=target_dir,
                              progress=False, out=str(tmp_path / "eval")),
                   echo=lambda line: None)
    assert out.online["d20"].walks[None].rounds == out.offline["d20"].walks[None].rounds


def test_vllm_serve_samples_reproducibly_by_the_request_seed_within_top_k(
        target_dir, server_url, tmp_path):
    """Sampled through vllm serve: the same --seed twice gives the same store (vLLM honours
    the per-request seed), another seed other answers, and with top-k 5 every stored draw is
    among the fp32 forward's top 5 (vLLM honours top-k)."""
    from dflash_train.target_model.sampling import SamplingConfig

    data = write_jsonl(tmp_path / "chats.jsonl", make_chats(8))
    answers = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        out = str(tmp_path / f"{name}.zarr")
        run_extract_cfg(target_dir, data, out, regenerate=True, max_new_tokens=NEW_TOKENS,
                        layers=",".join(map(str, LAYERS)), servers=[server_url],
                        sampling=SamplingConfig(temperature=1.0, top_k=5, seed=seed))
        samples = store_samples(out)
        answers[name] = [s.input_ids[s.loss_mask].tolist() for s in samples]
        for s in samples:
            drawn = s.input_ids[1:][s.loss_mask[1:]]
            top5 = s.topk_ids[:-1][s.loss_mask[1:], :5]
            assert (top5 == drawn[:, None]).any(dim=1).all(), s.source_row
    assert answers["a"] == answers["b"]
    assert answers["a"] != answers["c"]
    assert open_store(str(tmp_path / "a.zarr")).meta.server_drawn
