"""--capture generation: the states kept while generating are the states of the forward over
the same tokens (float rounding apart), the answers are the same, a killed run resumes to the
uninterrupted store, and auto falls back to the forward where a part's states would not fit."""

import pytest
import torch
from conftest import (
    assert_same_samples,
    cli_args,
    make_chats,
    run_cli,
    run_extract_cfg,
    store_samples,
    write_jsonl,
)
from transformers import AutoModelForCausalLM

from dflash_train.extract import fill
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.writer import KILL_AFTER_ENV
from dflash_train.store_schema import open_store, validate
from dflash_train.target_model.generate_capture import StatesToKeep, generate_with_states
from dflash_train.target_model.generation import continuations
from dflash_train.target_model.loading import load_target
from dflash_train.target_model.sampling import SamplingConfig
from tests.evaluate.conftest import EOS_ID

NEW = 6
LAYERS = [0, 1, 2]


def _hidden_states(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The independent expectation: transformers' own unpadded forward of one sample,
    ([n, layers, H] context, [n, V] logits)."""
    with torch.no_grad():
        out = model(ids[None].long(), output_hidden_states=True)
    context = torch.stack([out.hidden_states[k + 1][0] for k in LAYERS], dim=1)
    return context, out.logits[0]


@pytest.mark.parametrize("model_fixture", ["qwen3_dir", "qwen3_5_dir"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0, seed=3)],
                         ids=["greedy", "t1"])
def test_states_kept_in_generation_are_the_forwards(model_fixture, sampling, chats_jsonl,
                                                    tmp_path, request):
    model_dir = request.getfixturevalue(model_fixture)
    stores = {}
    for capture in ("generation", "forward"):
        out = str(tmp_path / f"{capture}.zarr")
        run_extract_cfg(model_dir, chats_jsonl, out, regenerate=True, max_new_tokens=NEW,
                        sampling=sampling, capture=capture)
        assert validate(out) == []
        stores[capture] = store_samples(out)
    kept, forward = stores["generation"], stores["forward"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # the hybrid's linear attention runs recurrently in generation and chunked in a forward:
    # float32 rounding of up to ~1e-4 here
    close = dict(rtol=1e-3, atol=5e-4)
    assert [s.source_row for s in kept] == [s.source_row for s in forward]
    for a, b in zip(kept, forward, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        context, logits = _hidden_states(model, a.input_ids)
        for s in (a, b):
            torch.testing.assert_close(s.context, context, **close)
            torch.testing.assert_close(s.lse, torch.logsumexp(logits, -1), **close)
            torch.testing.assert_close(s.topk_logits[:, 0], logits.max(-1).values, **close)
        assert torch.equal(a.topk_ids[:, 0], b.topk_ids[:, 0])
        if sampling.greedy:  # every answer token is its predecessor's stored argmax
            tail = a.loss_mask.nonzero()[:, 0]
            assert torch.equal(a.topk_ids[tail - 1, 0], a.input_ids[tail])


def test_a_killed_run_resumes_to_the_uninterrupted_store(qwen3_5_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_chats(14))
    """Every run through the CLI, in processes set up alike: a decoding step's GEMMs are
    thin enough that their rounding may follow the thread count, which tests run in-process
    may have changed."""
    flags = ["--regenerate", "--max-new-tokens", str(NEW), "--capture", "generation"]
    reference = str(tmp_path / "ref.zarr")
    assert run_cli(cli_args(qwen3_5_dir, data, reference) + flags).returncode == 0
    out = str(tmp_path / "hs.zarr")
    killed = run_cli(cli_args(qwen3_5_dir, data, out) + flags, **{KILL_AFTER_ENV: "3"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not open_store(out).complete
    assert run_cli(cli_args(qwen3_5_dir, data, out) + flags).returncode == 0
    assert_same_samples(store_samples(out), store_samples(reference))


def test_truncated_answers_keep_their_first_states(qwen3_dir, chats_jsonl, tmp_path):
    stores = {}
    for capture in ("generation", "forward"):
        out = str(tmp_path / f"{capture}.zarr")
        run_extract_cfg(qwen3_dir, chats_jsonl, out, regenerate=True, max_new_tokens=NEW,
                        max_length=28, capture=capture)
        stores[capture] = store_samples(out)
    assert any(len(s) == 28 for s in stores["forward"])
    for a, b in zip(stores["generation"], stores["forward"], strict=True):
        assert torch.equal(a.input_ids, b.input_ids)
        torch.testing.assert_close(a.context, b.context, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("limit, forwards", [(1 << 30, False), (1000, True)])
def test_auto_runs_the_forward_only_where_a_parts_states_would_not_fit(
        limit, forwards, qwen3_dir, chats_jsonl, tmp_path, monkeypatch):
    from dflash_train.extract import run

    monkeypatch.setattr(run, "CAPTURE_HOST_BYTES", limit)
    called = []
    real = fill._forward_batch
    monkeypatch.setattr(fill, "_forward_batch", lambda *a: called.append(1) or real(*a))
    run_extract_cfg(qwen3_dir, chats_jsonl, str(tmp_path / "hs.zarr"), regenerate=True,
                    max_new_tokens=NEW)
    assert bool(called) == forwards


@pytest.mark.parametrize("penalty", [None, 1.3], ids=["plain", "repetition-penalty"])
def test_rows_ending_on_eos_at_different_steps_get_the_forwards_states(target, penalty):
    """Against continuations() (the plain path) and transformers' own forward: rows that end
    on eos early, late or never; with the model's generation config adding a processor, the
    answers still follow it while the stored top-k stay the head's raw logits."""
    loaded = load_target(target, device="cpu", dtype=torch.float32, load_as="causal-lm")
    if penalty is not None:
        loaded.model.generation_config.repetition_penalty = penalty
    prompts = [[5, 9, 12, 40, 41], [7, 8], [30, 31, 32, 33], [60, 2, 61], [90]]
    how = dict(max_new_tokens=24, eos_ids=[EOS_ID], pad_id=0)
    plain = continuations(loaded.model, prompts, **how)
    kept = generate_with_states(loaded, prompts, StatesToKeep(LAYERS, 4), **how)
    ends = {len(a) for a in plain if a[-1] == EOS_ID}
    assert len(ends) > 1 and any(a[-1] != EOS_ID for a in plain), "rows must end apart"
    for p, answer, (got, states) in zip(prompts, plain, kept, strict=True):
        assert got == answer
        context, logits = _hidden_states(loaded.model, torch.tensor(p + answer))
        torch.testing.assert_close(states.context, context, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(states.topk_logits, logits.topk(4).values, rtol=1e-4,
                                   atol=1e-4)
        torch.testing.assert_close(states.lse, torch.logsumexp(logits, -1), rtol=1e-4,
                                   atol=1e-4)


def test_the_store_records_the_capture_and_a_resume_the_other_way_is_refused(qwen3_dir,
                                                                             tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_chats(3))
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(qwen3_dir, data, out, regenerate=True, max_new_tokens=NEW)
    assert open_store(out).meta.extra["capture"] == "generation"
    with pytest.raises(ExtractError, match="capture"):
        run_extract_cfg(qwen3_dir, data, out, regenerate=True, max_new_tokens=NEW,
                        capture="forward")
    forward = str(tmp_path / "forward.zarr")  # a forward store's provenance is as it was
    run_extract_cfg(qwen3_dir, data, forward, regenerate=True, max_new_tokens=NEW,
                    capture="forward")
    assert "capture" not in open_store(forward).meta.extra
