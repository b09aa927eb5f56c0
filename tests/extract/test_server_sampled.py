"""`extract --regenerate --server URL --temperature T`: the server samples with a seed per
request and its answers are stored as they come; the store says it is in-distribution only.
The fake server here draws as a real one does, from its own generator seeded by the request
(torch.multinomial), never with our keyed noise."""

import pytest
import torch

from dflash_train.extract.errors import ExtractError
from dflash_train.store_schema import open_store, validate
from dflash_train.store_schema.info import answers_description, topk_agreement
from dflash_train.store_schema.meta import DRAWN_BY_KEY
from dflash_train.target_model.sampling import SEED_LIMIT
from tests.extract.conftest import run_extract_cfg, store_samples
from tests.extract.test_server_generate import FakeVllm

NEW = 8
SAMPLED = dict(regenerate=True, max_new_tokens=NEW)


def _settings(temperature=0.9, top_p=0.95, top_k=0, seed=7):
    from dflash_train.target_model.sampling import SamplingConfig

    return SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


def _nucleus(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """probs with what top-k, then top-p, removes set to 0 (written here, not imported)."""
    if top_k:
        probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, 0)
    ordered, order = probs.sort(descending=True)
    before = ordered.cumsum(0) - ordered
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[before < top_p * probs.sum()]] = True
    return torch.where(keep, probs, 0)


class SamplingVllm(FakeVllm):
    """Answers sampled requests from a torch.Generator seeded by the request's seed; with
    `other_model`, uniform random ids instead (a server of another model). Keeps every
    request body."""

    def __init__(self, model_dir: str, other_model: bool = False):
        super().__init__(model_dir)
        self.other_model = other_model
        self.bodies: list[dict] = []

    def complete(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.bodies.append(body)
        prompt, stop = body["prompt"], set(body["stop_token_ids"])
        draws = torch.Generator().manual_seed(body["seed"])
        ids = list(prompt)
        with self.lock, torch.no_grad():
            for _ in range(body["max_tokens"]):
                logits = self.model(torch.tensor([ids])).logits[0, -1]
                if self.other_model:
                    probs = torch.ones_like(logits)
                else:
                    probs = _nucleus(torch.softmax(logits / body["temperature"], -1),
                                     body["top_k"], body["top_p"])
                ids.append(int(torch.multinomial(probs, 1, generator=draws)))
                if ids[-1] in stop:
                    break
        new = ids[len(prompt):]
        return 200, {"choices": [{"index": 0, "text": "", "token_ids": new,
                                  "prompt_token_ids": prompt,
                                  "finish_reason": "stop" if new[-1] in stop else "length"}]}


@pytest.fixture
def sampler(target):
    fake = SamplingVllm(target)
    yield fake
    fake.close()


def _answers(url: str) -> dict[int, list[int]]:
    return {s.source_row: s.input_ids[s.loss_mask].tolist() for s in store_samples(url)}


def test_a_sampled_store_holds_the_servers_draws_and_says_it_is_in_distribution_only(
        target, data, sampler, tmp_path):
    s = _settings(top_k=20)
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(target, data, out, sampling=s, servers=[sampler.url], **SAMPLED)
    assert validate(out) == []
    bodies = {tuple(b["prompt"]): b for b in sampler.bodies}
    for b in bodies.values():
        assert (b["temperature"], b["top_p"], b["top_k"], b["min_p"]) == (0.9, 0.95, 20, 0.0)
        assert 0 <= b["seed"] < SEED_LIMIT
    assert len({b["seed"] for b in bodies.values()}) == len(bodies)  # a stream per prompt
    for sample in store_samples(out):  # stored as they came
        prompt = sample.input_ids[~sample.loss_mask].tolist()
        again = SamplingVllm.complete(sampler, bodies[tuple(prompt)])[1]
        assert sample.input_ids[sample.loss_mask].tolist() == again["choices"][0]["token_ids"]
    meta = open_store(out).meta
    assert meta.sampling == {"temperature": 0.9, "top_p": 0.95, "top_k": 20, "seed": 7}
    assert meta.server_drawn and meta.extra[DRAWN_BY_KEY] == "server"
    assert "sampled by a server" in answers_description(meta)
    assert "in-distribution only" in answers_description(meta)
    within, total = topk_agreement(open_store(out))  # top-k 20 of the target's own law
    assert total > 0 and within >= 0.9 * total


def test_the_seed_decides_a_servers_draws(target, data, sampler, tmp_path):
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        out = str(tmp_path / f"{name}.zarr")
        run_extract_cfg(target, data, out, sampling=_settings(seed=seed),
                        servers=[sampler.url], **SAMPLED)
        runs[name] = _answers(out)
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]


def test_a_servers_sampled_store_is_not_resumed_by_the_builtin_sampler(target, data, sampler,
                                                                      tmp_path):
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(target, data, out, sampling=_settings(), servers=[sampler.url],
                    rows_per_part=5, **SAMPLED)
    with pytest.raises(ExtractError, match=DRAWN_BY_KEY):
        run_extract_cfg(target, data, out, sampling=_settings(), rows_per_part=5, **SAMPLED)


def test_another_models_draws_are_refused_by_the_forwards_top_k(target, data, tmp_path):
    other = SamplingVllm(target, other_model=True)
    out = tmp_path / "hs.zarr"
    try:
        with pytest.raises(ExtractError, match=r"lie among the target's own top-16.*another "
                                               r"model than --model"):
            run_extract_cfg(target, data, str(out), sampling=_settings(),
                            servers=[other.url], **SAMPLED)
    finally:
        other.close()
    within, total = topk_agreement(open_store(str(out)))
    assert within < 0.5 * total
