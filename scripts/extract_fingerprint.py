"""Fingerprint what `dflash extract` writes and says, to prove a refactor changes nothing.

Extracts the same 14 tiny chats (dflash_train.assets.tiny) with the tiny Qwen3 and Qwen3.5
targets on CPU in fp32, in one intra-op thread, under these cases:
  plain / regen         one process, stored answers / --regenerate (8 new tokens),
  workers               RANK 1 then RANK 0 of WORLD_SIZE 2, each in turn,
  fp8                   --context-dtype float8_e4m3,
  overlong-*            --max-length 40, truncating / skipping (and, regenerated, prompts
                        left no room),
  resume / regen-resume the CLI SIGKILLed after 7 appended samples, then the same run resumed,
  server                --regenerate --server against an in-process fake vLLM (the extract
                        tests' FakeVllm), 5 rows a part so later parts are generated ahead,
  dry-run, refusals     the plan printed; a changed --top-k onto a store, --top-k past the
                        vocabulary and a --max-length every row fails (their one-line errors),
and prints, per case, the sha256 of every file of the store (each zarr.json parsed and
re-dumped with sorted keys, so key order alone does not count; chunks byte for byte), then
the run's messages, its summary lines and the final (desc, n, total) of each extract progress
bar. Paths in the store are the work directory's, which is wiped and reused: run each tree's
copy with the same --work and diff the outputs, e.g.

    cd TREE && OMP_NUM_THREADS=1 python -m scripts.extract_fingerprint > fingerprint.txt
"""

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import tqdm.std

from dflash_train.assets.tiny import make_chats, save_qwen3, save_qwen3_5, write_jsonl
from dflash_train.extract.config import ExtractConfig
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.pipeline import run_extract
from dflash_train.extract.writer import KILL_AFTER_ENV

REPO = Path(__file__).resolve().parents[1]

SETTINGS = dict(device="cpu", dtype="float32", rows_per_part=5, shard_tokens=16,
                batch_tokens=96, layers="0,1,2")
REGEN = dict(regenerate=True, max_new_tokens=8)
KILL_AFTER = 7


def store_lines(out: Path) -> list[str]:
    lines = []
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == "zarr.json":
            data = json.dumps(json.loads(data), sort_keys=True).encode()
        lines.append(f"  {path.relative_to(out)} {hashlib.sha256(data).hexdigest()[:16]}")
    whole = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return [f"  store sha256 {whole}", *lines]


@contextlib.contextmanager
def recorded_bars(bars: list):
    """Record each progress bar's (desc, n, total) as it closes."""
    close = tqdm.std.tqdm.close

    def recording_close(self):
        if str(self.desc).startswith(("generate", "extract")) and not getattr(
                self, "_recorded", False):
            self._recorded = True
            bars.append(f"  bar {self.desc!r} n={self.n} total={self.total}")
        return close(self)

    tqdm.std.tqdm.close = recording_close
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        tqdm.std.tqdm.close = close


def extract(model: str, data: str, out: Path, rank: int = 0, world: int = 1,
            **settings) -> list[str]:
    """One run_extract with progress bars on: its messages, summary lines and bars."""
    said, bars = [], []
    cfg = ExtractConfig(model=model, data=[data], out=str(out),
                        **{**SETTINGS, "progress": True, **settings})
    with recorded_bars(bars):
        summary = run_extract(cfg, rank=rank, world_size=world, echo=said.append)
    return ([f"  said {line}" for line in said] + [f"  summary {line}" for line in
                                                   summary.lines()] + bars)


def killed_cli(model: str, data: str, out: Path, regenerate: bool) -> str:
    """The CLI run SIGKILLed after KILL_AFTER appended samples: its exit status."""
    args = ["--model", model, "--data", data, "--out", str(out), "--no-progress"]
    for key, value in SETTINGS.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    if regenerate:
        args += ["--regenerate", "--max-new-tokens", str(REGEN["max_new_tokens"])]
    code = "from dflash_train.extract.command import extract; extract()"
    env = {**os.environ, "PYTHONPATH": str(REPO), KILL_AFTER_ENV: str(KILL_AFTER)}
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True)
    return f"  killed run exit {done.returncode}"


def cases(targets: dict[str, str], data: str, work: Path):
    """(name, function of the store path returning its report lines)."""
    for name, model in targets.items():
        yield f"{name} plain", lambda out, m=model: extract(m, data, out)
        yield f"{name} regen", lambda out, m=model: extract(m, data, out, **REGEN)
        yield f"{name} workers", lambda out, m=model: (
            extract(m, data, out, rank=1, world=2) + extract(m, data, out, rank=0, world=2))
        yield f"{name} regen-workers", lambda out, m=model: (
            extract(m, data, out, rank=1, world=2, **REGEN)
            + extract(m, data, out, rank=0, world=2, **REGEN))
    qwen3 = targets["qwen3"]
    yield "qwen3 fp8", lambda out: extract(qwen3, data, out, context_dtype="float8_e4m3")
    yield "qwen3 overlong-truncate", lambda out: extract(qwen3, data, out, max_length=40)
    yield "qwen3 overlong-skip", lambda out: extract(qwen3, data, out, max_length=40,
                                                     overlong="skip")
    yield "qwen3 regen-overlong", lambda out: extract(qwen3, data, out, max_length=40, **REGEN)
    for name, model in targets.items():
        yield f"{name} resume", lambda out, m=model: (
            [killed_cli(m, data, out, False)] + extract(m, data, out))
        yield f"{name} regen-resume", lambda out, m=model: (
            [killed_cli(m, data, out, True)] + extract(m, data, out, **REGEN))
    yield "eos server", lambda out: served(str(work / "eos"), data, out)
    yield "qwen3 dry-run", lambda out: extract(qwen3, data, out, dry_run=True, **REGEN)
    yield "qwen3 refusals", lambda out: (
        extract(qwen3, data, out) + refused(qwen3, data, out, top_k=8)
        + refused(qwen3, data, out, top_k=1000) + refused(qwen3, data, out, max_length=2))


def refused(model: str, data: str, out: Path, **settings) -> list[str]:
    """The one-line error of a run extract refuses."""
    try:
        extract(model, data, out, **settings)
    except ExtractError as e:
        return [f"  refused {e}"]
    return ["  not refused"]


def served(model: str, data: str, out: Path) -> list[str]:
    from tests.evaluate.conftest import save_eos_target
    from tests.extract.test_server_generate import FakeVllm

    save_eos_target(model)
    server = FakeVllm(model)
    try:
        return extract(model, data, out, servers=[server.url], server_requests=3, **REGEN)
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/dflash-extract-fingerprint",
                        help="Directory wiped and reused: the paths the stores record.")
    parser.add_argument("--only", default=None, help="Run only cases whose name holds this.")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    targets = {"qwen3": save_qwen3(work / "qwen3"), "qwen3_5": save_qwen3_5(work / "qwen3_5")}
    data = write_jsonl(work / "chats.jsonl", make_chats(14))
    for n, (name, run) in enumerate(cases(targets, data, work)):
        if args.only and args.only not in name:
            continue
        out = work / f"case{n:02d}.zarr"
        lines = run(out)
        print(name)
        print("\n".join(lines + store_lines(out)), flush=True)


if __name__ == "__main__":
    main()
