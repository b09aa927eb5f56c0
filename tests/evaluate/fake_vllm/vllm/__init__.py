"""A stand-in `vllm` for running engines/vllm_driver.py in a subprocess without vLLM (put on
PYTHONPATH by a fake "vLLM Python"). Every prompt of max_tokens m generates the tokens
100 .. 100 + m - 1. With a drafter, each verify step accepts 1 draft (commits 2 tokens) and
costs 30 ms of decode time; without one, each token costs 10 ms. Both timed as vLLM times a
request (RequestOutput.metrics: first and last token timestamps).

$FAKE_VLLM_LOG gets a line per generate call ("drafter N" / "plain N": N prompts);
$FAKE_VLLM_PIDS (a directory) a file per process; $FAKE_VLLM_FAIL=plain makes the engine
without a drafter fail to load.
"""

import math
import os
from pathlib import Path
from types import SimpleNamespace

__version__ = "fake"

STEP_SECONDS = 0.03
TOKEN_SECONDS = 0.01


def _note(line: str) -> None:
    if os.environ.get("FAKE_VLLM_LOG"):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(line + "\n")


class SamplingParams(SimpleNamespace):
    pass


class LLM:
    def __init__(self, **kwargs):
        if os.environ.get("FAKE_VLLM_PIDS"):
            Path(os.environ["FAKE_VLLM_PIDS"], str(os.getpid())).write_text("")
        self.spec = kwargs.get("speculative_config")
        if self.spec is None and os.environ.get("FAKE_VLLM_FAIL") == "plain":
            raise RuntimeError("fake vLLM: cannot load the target alone")
        self.steps = []

    def _answer(self, prompt: dict, params: SamplingParams) -> SimpleNamespace:
        tokens = [100 + i for i in range(params.max_tokens)]
        metrics = None
        if self.spec is not None:
            steps = math.ceil((len(tokens) - 1) / 2)
            drafts = self.spec["num_speculative_tokens"]
            metrics = SimpleNamespace(per_step_accepted=[1] * steps,
                                      per_step_drafted=[drafts] * steps)
            self.steps += [1] * steps
            seconds = STEP_SECONDS * steps
        else:
            seconds = TOKEN_SECONDS * (len(tokens) - 1)
        completion = SimpleNamespace(token_ids=tokens, finish_reason="length",
                                     spec_decode_metrics=metrics)
        return SimpleNamespace(outputs=[completion], metrics=SimpleNamespace(
            first_token_ts=1000.0, last_token_ts=1000.0 + seconds))

    def generate(self, prompts, params, use_tqdm):
        _note(f"{'drafter' if self.spec else 'plain'} {len(prompts)}")
        return [self._answer(p, q) for p, q in zip(prompts, params, strict=True)]

    def get_metrics(self):
        if self.spec is None:
            return []
        drafts = self.spec["num_speculative_tokens"]
        per_pos = [sum(a > k for a in self.steps) for k in range(drafts)]
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=len(self.steps)),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens",
                                value=sum(self.steps)),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos",
                                values=per_pos)]
