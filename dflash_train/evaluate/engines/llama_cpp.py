"""`eval --served --engine llama.cpp`: its mode, its plan, and the driver that asks
llama-server and turns its answers into rounds. llama-server (started and asked by
llama_server.py) serves the target GGUF with each checkpoint exported as a DFlash GGUF
(`dflash export --format gguf`), greedy (on a sampled store: its settings, in our sampler
order, with a seed per request: `request_body`), one prompt at a time, and its counts
become rounds through shared.served_decode, beside offline replay and `--online`. Its
answers are read and checked by llama_replies.py (what llama.cpp tells per request is listed
there); this module never parses a reply itself.

The stop rule is `--online`'s, applied here to llama-server's output: it may generate a block
past the cap (n_predict = cap + block), because near its n_predict llama-server shortens the
draft to the tokens left and drafts none for the last one, which our loop never does; the
text is cut where --online stops and the steps are kept up to the one that reaches that
point. llama.cpp stops by itself at its end-of-generation tokens; where one is not among
--online's end-of-turn ids the texts differ and the report names that as a likely cause.

llama.cpp's convention (the `llama_cpp` block of the served summary) is vLLM's: accepted
drafts per verify step, counted before the stop check, over the steps that made the text;
mean acceptance length = 1 + accepted / steps.
"""

import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.dtypes import torch_dtype as named_dtype
from dflash_train.evaluate.config import EvalConfig
from dflash_train.evaluate.engines.llama_replies import (
    Step,
    check_steps,
    metrics_agree,
    parse_completion,
    parse_metrics,
    parse_steps,
)
from dflash_train.evaluate.engines.llama_server import (
    LlamaServer,
    ServerSetup,
    find_llama_server,
)
from dflash_train.evaluate.engines.shared import (
    ServedDecode,
    ServedMode,
    ServedPrompt,
    ServedResults,
    ServeJob,
    checked_target_config,
    in_scratch,
    served_decode,
)
from dflash_train.evaluate.engines.speed import (
    TimedDecode,
    in_turn,
    speed_summary,
)
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.online import StopRule
from dflash_train.store_schema import Store
from dflash_train.target_model.sampling import GREEDY, SamplingConfig, request_seed

LOG_SECONDS = 30.0
"""How long the log may lag the response (llama.cpp logs from a worker thread)."""


def cut_at_stop(prompt: ServedPrompt, generated: list[int], stop: StopRule) -> list[int]:
    """The generated tokens --online's stop rule keeps (through the first token it stops on)."""
    for n, token in enumerate(generated, start=1):
        if stop.done(token, n, len(prompt.ids) + n):
            return generated[:n]
    return generated


def steps_for(steps: list[Step], n_tokens: int) -> list[Step]:
    """The steps that made the first `n_tokens` generated tokens (the first is the prefill's):
    each but the last commits accepted + 1."""
    kept, made = [], 1
    for step in steps:
        if made >= n_tokens:
            break
        kept.append(step)
        made += step[0] + 1
    return kept


SAMPLED_CHAIN = ["top_k", "temperature", "top_p"]
"""llama.cpp's sampler chain at T > 0, in our order (target_model/sampling.py, and vLLM's):
top-p over the tempered distribution. Its default chain (penalties, dry, top_n_sigma, top_k,
typ_p, top_p, min_p, xtc, temperature: common/common.h) applies top-p before the temperature,
another law. Top-k commutes with the temperature. Only the samplers named run
(common/sampling.cpp common_sampler_init), then its `dist` draw: penalties, DRY, XTC, typical
and min-p are left out whatever their values; mirostat stays at the server's 0."""


def request_body(prompt: ServedPrompt, block_size: int, sampling: SamplingConfig = GREEDY
                 ) -> dict:
    """Greedy on our ids, nothing cached; a block of tokens past the cap so that no draft
    inside --online's text is shortened (see the module docstring). On a sampled store: the
    store's temperature, top-k (0: off, as in llama.cpp) and top-p (1: off) in SAMPLED_CHAIN,
    min_p 0 besides, and the prompt's own seed (sampling.request_seed)."""
    body = {"prompt": prompt.ids, "n_predict": prompt.max_tokens + block_size,
            "temperature": 0.0, "samplers": ["temperature"], "cache_prompt": False,
            "return_tokens": True, "stream": False, "seed": 0}
    if not sampling.greedy:
        body |= {"temperature": sampling.temperature, "top_k": sampling.top_k,
                 "top_p": sampling.top_p, "min_p": 0.0, "samplers": SAMPLED_CHAIN,
                 "seed": request_seed(sampling.seed, prompt.sample.source_row)}
    return body



def request_steps(server: LlamaServer, offset: int, where: str) -> list[Step]:
    """The steps its log records from `offset` to the request's end (the log may lag)."""
    deadline = time.monotonic() + LOG_SECONDS
    while True:
        steps, done = parse_steps(server.read_log(offset), where)
        if done:
            return steps
        if time.monotonic() > deadline:
            raise server.failure(f"logged no end of the request within {LOG_SECONDS:.0f} s "
                                 f"({where})")
        time.sleep(0.05)


@dataclass
class Served:
    """One prompt through llama-server."""

    decode: ServedDecode
    steps: list[Step]
    """Every verify step of the request, past --online's stop too."""
    early_eog: bool
    """It stopped on an end-of-generation token --online does not stop on."""
    timing: TimedDecode
    """Its whole generation (past --online's stop too) as llama-server timed it."""


def serve_prompt(server: LlamaServer, prompt: ServedPrompt, block_size: int, stop: StopRule,
                 vocab: int, name: str, sampling: SamplingConfig = GREEDY) -> Served:
    where = f"llama-server, checkpoint {name}, prompt {prompt.key}"
    offset = server.log_size()
    raw = server.complete(request_body(prompt, block_size, sampling), f"prompt {prompt.key}")
    done = parse_completion(raw, len(prompt.ids), vocab, where)
    steps = request_steps(server, offset, where)
    check_steps(steps, done, block_size, where)
    text = cut_at_stop(prompt, done.tokens, stop)
    kept = steps_for(steps, len(text))
    decode = served_decode(prompt, {"token_ids": text,
                                    "per_step_accepted": [a for a, _ in kept],
                                    "per_step_drafted": [d for _, d in kept]}, block_size,
                           LlamaCppMode.title)
    ended = len(prompt.ids) + len(text)
    early = (done.stop_type == "eos" and text == done.tokens
             and not stop.done(text[-1], len(text), ended))
    return Served(decode, steps, early,
                  TimedDecode(done.tokens, done.decode_seconds, len(steps)))


def time_prompt(server: LlamaServer, prompt: ServedPrompt, block_size: int, vocab: int,
                name: str, sampling: SamplingConfig = GREEDY) -> TimedDecode:
    """One prompt through the llama-server without a drafter, asked what the drafter's
    server is asked."""
    where = f"llama-server without the drafter, checkpoint {name}, prompt {prompt.key}"
    raw = server.complete(request_body(prompt, block_size, sampling),
                          f"prompt {prompt.key} without the drafter")
    done = parse_completion(raw, len(prompt.ids), vocab, where)
    return TimedDecode(done.tokens, done.decode_seconds)


# -- a run of every checkpoint -------------------------------------------------------------


@dataclass
class LlamaPlan:
    """What a llama.cpp served run needs besides the job, all checked before it runs."""

    binary: str
    version: str
    """What `llama-server --version` says after "version: "."""
    target: str
    """The target GGUF (--model)."""
    target_type: str
    """Its weights' type as its general.file_type names it (ALL_F32, MOSTLY_Q8_0, ...)."""
    vocab: int
    dtype: str
    """The store's dtype: the drafter's matrices are exported in it."""
    threads: int


def server_version(binary: str) -> str:
    """`llama-server --version`'s version line, or why there is none (never fatal)."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = [x for x in (done.stdout + done.stderr).splitlines() if x.startswith("version: ")]
    return lines[0].removeprefix("version: ") if lines else "unknown"


def target_file_type(path: Path) -> str:
    """The target GGUF's general.file_type by name (ALL_F32, MOSTLY_Q8_0, ...), which says
    how llama.cpp computes it; "unknown" when the key is absent or unnamed."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path).fields.get("general.file_type")
    try:
        return LlamaFileType(int(field.contents())).name
    except (AttributeError, TypeError, ValueError):
        return "unknown"


def llama_plan(cfg: EvalConfig, store: Store) -> LlamaPlan:
    """Find llama-server and check --model is the store's target, before the first forward."""
    from dflash_train.target_config import config_field, text_part

    binary = find_llama_server(cfg.llama_server)
    config = checked_target_config(cfg.model, store)
    return LlamaPlan(binary=binary, version=server_version(binary),
                     target=str(Path(cfg.model).resolve()),
                     target_type=target_file_type(Path(cfg.model)),
                     vocab=config_field(text_part(config), "vocab_size"),
                     dtype=store.meta.hidden_dtype, threads=torch.get_num_threads())


def export_drafters(checkpoints: dict[str, tuple[str, int]], plan: LlamaPlan, workdir: Path
                    ) -> dict[str, Path]:
    """Each checkpoint as a DFlash GGUF beside the target (drafter/gguf_export.py)."""
    from dflash_train.drafter import DrafterError
    from dflash_train.drafter.gguf_export import export_gguf

    out = {}
    for name, (path, _) in checkpoints.items():
        try:
            out[name] = export_gguf(path, workdir / f"{name}.gguf", plan.target,
                                    dtype=named_dtype(plan.dtype))
        except DrafterError as e:
            raise EvalError(f"--served --engine llama.cpp {name}: cannot export {path} as a "
                            f"llama.cpp GGUF ({e})") from e
    return out


def context_size(prompts: list[ServedPrompt], block_size: int) -> int:
    """Room for the longest request and a block more: llama-server drafts only
    n_ctx - tokens - 2 near the end of its context (server-context.cpp)."""
    return max(len(p.ids) + p.max_tokens for p in prompts) + 3 * block_size


SPEED_TIMING = "llama-server's timings.predicted_ms of each request"
"""What the speed block's decode times are: from the first generated token (made by the
prompt's processing) to the last (server-common.h, t_gen_ms)."""


def serve_checkpoint(plan: LlamaPlan, job: ServeJob, name: str, drafter: Path,
                     workdir: Path) -> ServedResults:
    """One llama-server with this drafter (and, for speed, one without it, the two taking
    turns prompt by prompt), every prompt in turn, then its /metrics."""
    block_size = job.checkpoints[name][1]
    context = context_size(job.prompts, block_size)

    def server(gguf: Path | None, log: str) -> LlamaServer:
        setup = ServerSetup(plan.binary, plan.target, None if gguf is None else str(gguf),
                            block_size, context, plan.threads, workdir / log)
        return LlamaServer(setup, note=lambda line: job.echo(f"served: {name}: {line}"))

    start = time.monotonic()
    with ExitStack() as running:
        drafting = running.enter_context(server(drafter, f"{name}.log"))
        plain = (running.enter_context(server(None, f"{name}.without-drafter.log"))
                 if job.speed else None)
        loaded = time.monotonic()
        served, timed, generating = _decode_all(drafting, plain, plan, job, name)
        metrics = parse_metrics(drafting.metrics(), f"llama-server, checkpoint {name}")
    steps = [s for x in served for s in x.steps]
    info = {"versions": {LlamaCppMode.engine: plan.version}, "server": plan.binary,
            "target_type": plan.target_type,
            "stopped_on_other_eog": [x.decode.prompt.key for x in served if x.early_eog],
            "seconds": {"load": loaded - start, "generate": generating}}
    speed = None if plain is None else speed_summary(
        [x.timing for x in served], timed, timing=SPEED_TIMING,
        concurrency="one prompt at a time")
    return ServedResults(name, block_size, [x.decode for x in served], metrics,
                         job.position_bin, LlamaCppMode.report_key, info,
                         counters_agree=metrics_agree(metrics, steps, block_size), speed=speed)


def _decode_all(server: LlamaServer, plain: LlamaServer | None, plan: LlamaPlan, job: ServeJob,
                name: str) -> tuple[list[Served], list[TimedDecode], float]:
    """Every prompt through `server` (and `plain`, taking turns with it); the seconds spent
    in `server`'s turns."""
    block_size = job.checkpoints[name][1]
    served: list[Served] = []
    timed: list[TimedDecode] = []
    generating = 0.0
    for turn, prompt in enumerate(job.prompts):
        for drafting in in_turn([True, False] if plain is not None else [True], turn):
            if drafting:
                began = time.monotonic()
                served.append(serve_prompt(server, prompt, block_size, job.stop, plan.vocab,
                                           name, job.sampling))
                generating += time.monotonic() - began
            else:
                timed.append(time_prompt(plain, prompt, block_size, plan.vocab, name,
                                         job.sampling))
    return served, timed, generating


def serve_llama(plan: LlamaPlan, job: ServeJob) -> dict[str, ServedResults]:
    """Serve each checkpoint and decode every prompt. Exports and logs live in a temporary
    directory, removed when every run succeeded and kept (named in the error) when one
    failed."""
    def serve(workdir: Path, drafters: dict[str, Path]) -> dict[str, ServedResults]:
        results = {}
        for name in job.checkpoints:
            plain = " and again without it for speed" if job.speed else ""
            job.echo(f"served: {name}: llama-server ({plan.version}) serves {plan.target} "
                     f"({plan.target_type}) with the drafter{plain}, {len(job.prompts)} "
                     f"prompts (log: {workdir / name}.log)")
            try:
                results[name] = serve_checkpoint(plan, job, name, drafters[name], workdir)
            except EvalError as e:
                raise EvalError(f"{e} (exports and logs kept in {workdir})") from e
            seconds = results[name].info["seconds"]
            job.echo(f"served: {name}: done (load {seconds['load']:.0f} s, generate "
                     f"{seconds['generate']:.1f} s with the drafter)")
        return results

    return in_scratch("dflash-served-llama-",
                      lambda workdir: export_drafters(job.checkpoints, plan, workdir), serve)


# -- its mode -----------------------------------------------------------------------------


class LlamaCppMode(ServedMode):
    """`--served --engine llama.cpp`: llama-server with each checkpoint exported as a DFlash
    GGUF."""

    engine = "llama.cpp"
    report_key = "llama_cpp"
    title = "llama.cpp"

    def check_options(self, cfg: EvalConfig) -> None:
        super().check_options(cfg)
        if cfg.vllm_python:
            raise EvalError("--vllm-python only applies to --served --engine vllm")
        model = Path(cfg.model)
        if model.suffix.lower() != ".gguf" or not model.is_file():
            raise EvalError(f"--served --engine llama.cpp --model {cfg.model}: llama-server "
                            "serves a target .gguf file and this is not one (convert the "
                            "target with llama.cpp's convert_hf_to_gguf.py; float32 for a "
                            "like-for-like check)")
        find_llama_server(cfg.llama_server)  # a wrong --llama-server is refused before work

    def plan_for(self, cfg, store):
        return llama_plan(cfg, store)

    def serve(self, job):
        self.served = serve_llama(self.plan, job)
        return self.served

    def causes(self, diff, inputs, name):
        served = "float32" if self.plan.target_type == "ALL_F32" else self.plan.target_type
        causes = self.engine_causes(diff, inputs, name, served_dtype=served,
                                    drafter_dtype=self.plan.dtype)
        if diff["kind"] == "text" and \
                diff["prompt"] in self.served[name].info["stopped_on_other_eog"]:
            causes.insert(1, "llama.cpp stopped on an end-of-generation token of its "
                             "vocabulary that --online's stop rule does not end on")
        return causes
