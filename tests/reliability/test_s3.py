"""A real object store end to end: extract -> train -> eval against `s3://` served by moto on
loopback, a SIGKILLed writer resumed on S3, and part claims that keep two writers apart."""

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from dflash_train.assets.tiny import SPECIALS, make_chats, save_qwen3, write_jsonl
from dflash_train.cli import main
from dflash_train.extract.claims import (
    FORCE_ENV,
    ClaimRecord,
    ObjectClaim,
    claims_dir,
    exclusive,
)
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.writer import KILL_AFTER_ENV
from dflash_train.store_schema import StoreError, open_store, validate
from tests.reliability import kill_children
from tests.reliability.kill_points import run_child
from tests.reliability.s3_server import S3Endpoint, serve_s3, subprocess_env

REPO = Path(__file__).resolve().parents[2]
ROWS = 9  # two parts of 5 rows: the second one short
MASK_ID = str(SPECIALS.index("<|mask|>"))  # the tiny tokenizer's specials come first


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    yield from serve_s3()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[str, str]:
    tmp = tmp_path_factory.mktemp("s3_inputs")
    return str(save_qwen3(tmp / "qwen3")), write_jsonl(tmp / "chats.jsonl", make_chats(ROWS))


def extract_args(inputs: tuple[str, str], out: str) -> list[str]:
    model, data = inputs
    return ["extract", "--model", model, "--data", data, "--out", out, "--device", "cpu",
            "--dtype", "float32", "--rows-per-part", "5", "--shard-tokens", "16",
            "--batch-tokens", "96", "--layers", "0,1,2", "--mask-token-id", MASK_ID,
            "--no-progress"]


def dflash(*args: str) -> str:
    """`dflash ARGS` in this process; the output, after asserting exit status 0."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def samples(url: str) -> list:
    return [s for p in open_store(url).parts() for s in p.iter_samples()]


def assert_same_arrays(a: list, b: list) -> None:
    assert [s.source_row for s in a] == [s.source_row for s in b]
    for x, y in zip(a, b, strict=True):
        for name in ("input_ids", "loss_mask", "context", "topk_ids", "topk_logits", "lse"):
            assert torch.equal(getattr(x, name), getattr(y, name)), (name, x.source_row)


@pytest.fixture(scope="module")
def local_store(inputs, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("local") / "hs.zarr")
    dflash(*extract_args(inputs, out))
    return out


def train_and_eval(store: str, run: Path) -> tuple[dict, dict]:
    """Two train steps on `store`, then eval of the checkpoint on `store`: (weights, report)."""
    dflash("train", "--store", store, "--out", str(run), "--max-steps", "2", "--layers", "1",
           "--device", "cpu", "--batch-tokens", "128", "--anchors-per-seq", "2",
           "--no-progress")
    ckpt = max(run.glob("checkpoints/step_*"))
    report = json.loads(dflash("eval", "--store", store, str(ckpt), "--device", "cpu",
                               "--json", "--no-progress"))
    weights = {}
    for f in sorted(ckpt.rglob("*.safetensors")):
        weights.update({f"{f.name}:{k}": v for k, v in load_file(f).items()})
    return weights, report


def _normalised(report: dict, store: str, run: Path) -> str:
    return json.dumps(report, sort_keys=True).replace(store, "STORE").replace(str(run), "RUN")


def test_extract_train_eval_on_s3_equal_the_same_run_on_a_local_disk(s3, inputs, local_store,
                                                                      tmp_path):
    url = s3.url("e2e/hs.zarr")
    dflash(*extract_args(inputs, url))
    assert open_store(url).complete and validate(url) == []
    assert_same_arrays(samples(url), samples(local_store))
    assert any(k.startswith("e2e/hs.zarr/parts/") for k in s3.keys("e2e/"))

    s3_weights, s3_report = train_and_eval(url, tmp_path / "run_s3")
    local_weights, local_report = train_and_eval(local_store, tmp_path / "run_local")
    assert s3_weights.keys() == local_weights.keys() and s3_weights
    for k, v in s3_weights.items():
        assert torch.equal(v, local_weights[k]), k
    # the reports differ only in where the store and the run live
    assert _normalised(s3_report, url, tmp_path / "run_s3") == \
        _normalised(local_report, local_store, tmp_path / "run_local")
    assert s3_report["checkpoints"][0]["offline"]["n_blocks"] > 0

def test_a_sigkilled_extract_into_s3_resumes_to_the_uninterrupted_arrays(s3, inputs,
                                                                          local_store):
    url = s3.url("resume/hs.zarr")
    code = "from dflash_train.cli import main; main()"
    killed = subprocess.Popen(
        [sys.executable, "-c", code, *extract_args(inputs, url)], cwd=REPO,
        env=subprocess_env(s3, PYTHONPATH=str(REPO), **{KILL_AFTER_ENV: "3"}),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL, err[-2000:]
    assert not open_store(url).complete
    # the killed writer's claim is still there and says held: the resume must see it is dead
    left = [_read_json(s3, k) for k in s3.keys("resume/hs.zarr.claims/part-")]
    assert {c["pid"] for c in left} == {killed.pid}
    assert "held" in [c["state"] for c in left]

    dflash(*extract_args(inputs, url))
    resumed, reference = samples(url), samples(local_store)
    assert_same_arrays(resumed, reference)
    assert sorted(s.source_row for s in resumed) == list(range(ROWS))
    assert dflash("store", "validate", url).splitlines()[-1] == f"{url}: ok"


def test_an_extract_killed_inside_the_frozen_unit_on_s3_is_refused_then_made_whole(
        s3, inputs, local_store, tmp_path):
    """No rename on S3: the unit's record, one PUT written last, is its commit."""
    url = s3.url("frozen/hs.zarr")
    killed = run_child(kill_children.extract_killed_in_frozen, (extract_args(inputs, url)[1:],),
                       tmp_path, env=s3.env)
    assert killed.exitcode == -signal.SIGKILL, killed.error
    cut = open_store(url)
    assert cut.frozen_record().state == "unfinished"
    with pytest.raises(StoreError, match="creation was cut short"):
        cut.read_files("tokenizer")
    assert validate(url) == []  # in flight, not damage
    unfinished = CliRunner().invoke(main, ["store", "validate", url, "--require-complete"])
    assert unfinished.exit_code == 1 and "target rows and files not all written" in \
        unfinished.output

    dflash(*extract_args(inputs, url))
    whole, local = open_store(url), open_store(local_store)
    assert whole.frozen_record() == local.frozen_record()
    assert whole.read_files("tokenizer") == local.read_files("tokenizer")
    assert_same_arrays(samples(url), samples(local_store))
    assert dflash("store", "validate", url).splitlines()[-1] == f"{url}: ok"


# -- claims --------------------------------------------------------------------------------


def _read_json(server: S3Endpoint, key: str) -> dict:
    import fsspec

    fs, _ = fsspec.core.url_to_fs(server.url(key))
    fs.invalidate_cache()
    return json.loads(fs.cat_file(server.url(key)))


def _foreign_record(gen: int, heartbeat: float) -> ClaimRecord:
    """A claim written by a process on another machine."""
    return ClaimRecord(owner="other", host="elsewhere", machine="another-boot/pid:[1]",
                       pid=1, pid_start=None, generation=gen, heartbeat=heartbeat,
                       state="held")


def _plant(url: str, name: str, record: ClaimRecord) -> None:
    import fsspec

    fs, directory = fsspec.core.url_to_fs(claims_dir(url))
    fs.pipe_file(f"{directory}/{name}.{record.generation:08d}.json",
                 json.dumps(record.__dict__).encode())


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_second_writer_of_a_claimed_part_gets_a_clear_error(kind, request, tmp_path):
    # the same rule on both kinds of store: flock locally, a claim object on S3
    if kind == "s3":
        out = request.getfixturevalue("s3").url("claims/a.zarr")
    else:
        out = str(tmp_path / "a.zarr")
    with exclusive(out, "part-00003", wait=False):
        with pytest.raises(ExtractError, match="part-00003 is being written by"):
            with exclusive(out, "part-00003", wait=False):
                pass
        with exclusive(out, "part-00004", wait=False):  # other parts stay free
            pass
    with exclusive(out, "part-00003", wait=False):  # released: free again
        pass


def test_released_claims_keep_growing_generations_and_old_ones_are_removed(s3):
    url = s3.url("claims/gen.zarr")
    for _ in range(3):
        with exclusive(url, "part-00000", wait=False):
            pass
    names = [k.rsplit("/", 1)[-1] for k in s3.keys("claims/gen.zarr.claims/")]
    assert names == ["part-00000.00000002.json"]


def test_a_claim_whose_process_died_on_this_machine_is_taken_over_at_once(s3):
    url = s3.url("claims/dead.zarr")
    code = ("import os, signal; from dflash_train.extract.claims import exclusive\n"
            f"with exclusive({url!r}, 'part-00000', wait=False):\n"
            "    os.kill(os.getpid(), signal.SIGKILL)")
    dead = subprocess.run([sys.executable, "-c", code], env=subprocess_env(s3), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert dead.returncode == -signal.SIGKILL, dead.stderr[-2000:]
    assert s3.keys("claims/dead.zarr.claims/") == [
        "claims/dead.zarr.claims/part-00000.00000000.json"]
    with exclusive(url, "part-00000", wait=False, stale_after=3600):
        pass


def test_another_machines_claim_blocks_until_its_heartbeat_is_stale(s3):
    import time

    url = s3.url("claims/foreign.zarr")
    _plant(url, "part-00000", _foreign_record(0, heartbeat=time.time() - 100))
    with pytest.raises(ExtractError, match="elsewhere pid 1.*DFLASH_CLAIM_STALE_S"):
        with exclusive(url, "part-00000", wait=False, stale_after=1000):
            pass
    with exclusive(url, "part-00000", wait=False, stale_after=50):  # 100 s > 50 s: stale
        pass


def test_forcing_a_live_claim_makes_the_old_holder_fail_at_release(s3, monkeypatch):
    url = s3.url("claims/force.zarr")
    holder = ObjectClaim.acquire(url, "part-00000", wait=False, stale_after=3600)
    monkeypatch.setenv(FORCE_ENV, "1")
    with exclusive(url, "part-00000", wait=False, stale_after=3600):
        with pytest.raises(ExtractError, match="taken over"):
            holder.release()


def test_a_waiting_claimer_gets_the_claim_once_the_holder_releases_it(s3, monkeypatch):
    import time

    from dflash_train.extract import claims

    url = s3.url("claims/wait.zarr")
    holder = ObjectClaim.acquire(url, "create", wait=False, stale_after=3600)
    waiting, released = threading.Event(), threading.Event()

    def poll_pause(_seconds):  # instead of sleeping: tell the test, then wait for release
        waiting.set()
        assert released.wait(60)

    monkeypatch.setattr(claims, "time", SimpleNamespace(time=time.time, sleep=poll_pause))
    got = []
    waiter = threading.Thread(target=lambda: got.append(
        ObjectClaim.acquire(url, "create", wait=True, stale_after=3600)))
    waiter.start()
    assert waiting.wait(60)  # the waiter saw a live claim and is polling
    holder.release()
    released.set()
    waiter.join(60)
    assert [c.record.generation for c in got] == [holder.record.generation + 1]
    got[0].release()


def test_a_holder_heartbeat_moves_its_claim_forward(s3):
    url = s3.url("claims/beat.zarr")
    holder = ObjectClaim.acquire(url, "part-00000", wait=False, stale_after=3600)
    first = holder.record.heartbeat
    holder.beat()
    import fsspec

    fs, _ = fsspec.core.url_to_fs(url)
    stored = json.loads(fs.cat_file(holder.path))
    assert stored["heartbeat"] == holder.record.heartbeat >= first
    assert stored["state"] == "held"
    holder.release()
    assert json.loads(fs.cat_file(holder.path))["state"] == "released"


def test_while_held_a_claim_is_refreshed_by_its_heartbeat_thread(s3, monkeypatch):
    url = s3.url("claims/thread.zarr")
    beaten = threading.Event()
    original = ObjectClaim.beat

    def beat(self):
        original(self)
        beaten.set()

    monkeypatch.setattr(ObjectClaim, "beat", beat)
    with exclusive(url, "part-00000", wait=False, stale_after=0.2):  # a beat every 0.05 s
        assert beaten.wait(30)
        stored = _read_json(s3, "claims/thread.zarr.claims/part-00000.00000000.json")
        assert stored["state"] == "held" and stored["pid"] == os.getpid()
    assert _read_json(s3, "claims/thread.zarr.claims/part-00000.00000000.json")["state"] \
        == "released"


def test_of_writers_racing_for_one_part_exactly_one_wins(s3):
    url = s3.url("claims/race.zarr")
    n = 6
    gate = threading.Barrier(n)
    won, refused = [], []

    def racer():
        gate.wait()
        try:
            won.append(ObjectClaim.acquire(url, "part-00000", wait=False, stale_after=3600))
        except ExtractError:
            refused.append(1)

    threads = [threading.Thread(target=racer) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == n - 1
    won[0].release()


def test_extract_refuses_a_part_another_live_writer_holds(s3, inputs):
    url = s3.url("claims/held.zarr")
    with exclusive(url, "part-00001", wait=False):
        result = CliRunner().invoke(main, extract_args(inputs, url))
    assert result.exit_code == 1
    assert "part-00001 is being written by" in result.output
    assert sorted(s.source_row for s in samples(url)) == list(range(5))  # part 0 only


def test_a_bucket_root_store_is_refused_with_a_hint(s3):
    with pytest.raises(ExtractError, match="bucket root"):
        with exclusive(f"s3://{s3.bucket}", "create", wait=True):
            pass
