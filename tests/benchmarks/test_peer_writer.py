"""benchmarks/peer/writer.py: a store as speculators' training files, checked against the store
read back sample by sample, without speculators installed (its format is `datasets` +
safetensors, both in our environment)."""

import json

import numpy as np
import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from benchmarks.peer.writer import (
    HIDDEN_DIR,
    SAMPLES_NAME,
    speculators_layer_ids,
    write_dataset,
)
from dflash_train.store_schema import StoreError, open_store
from tests.train.conftest import HIDDEN, LAYERS, build_store


def seeded_final(input_ids: torch.Tensor) -> torch.Tensor:
    """A stand-in final layer that depends on the tokens only: [L, H] float32."""
    gen = torch.Generator().manual_seed(int(input_ids.sum()))
    return torch.randn(len(input_ids), HIDDEN, generator=gen)


def head_final(store):
    """A final layer whose verifier head argmax is the stored argmax on most tokens: the lm_head
    row of the stored label, scaled (random rows are near-orthogonal at H = 32)."""
    lm_head = store.target_rows()["lm_head"].float()
    by_ids = {}
    for part in store.parts():
        for s in part.iter_samples():
            by_ids[tuple(s.input_ids.tolist())] = s.topk_ids[:, 0].long()
    return lambda ids: 3.0 * lm_head[by_ids[tuple(ids.tolist())]]


def reference_agreement(store, final) -> float:
    """The share of tokens where lm_head(rmsnorm(final) * scale) picks the stored argmax,
    computed here in numpy."""
    rows = store.target_rows()
    w, scale = rows["lm_head"].float().numpy(), rows["final_norm"].float().numpy()
    same = total = 0
    for part in store.parts():
        for s in part.iter_samples():
            x = final(s.input_ids).numpy().astype(np.float64)
            x = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * scale
            same += int(((x @ w.T).argmax(-1) == s.topk_ids[:, 0].numpy()).sum())
            total += len(s)
    return same / total


@pytest.fixture(scope="module")
def store_url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("peer") / "hs.zarr")
    build_store(url, rows=8, parts=2)
    # a final norm that is not all ones, so the check must apply it per channel
    store = open_store(url, "r+")
    rows = store.target_rows()
    scale = torch.linspace(0.2, 3.0, HIDDEN)[torch.randperm(HIDDEN,
                                                            generator=torch.Generator())]
    store.write_target_rows(rows["embed_tokens"], rows["lm_head"], scale)
    return url


def test_every_sample_becomes_one_row_and_one_file_holding_its_context_then_final(
        store_url, tmp_path):
    out = tmp_path / "spec"
    written = write_dataset(store_url, out, seeded_final, min_agreement=0.0)
    store = open_store(store_url)
    expected = [(p.index, i, s) for p in store.parts() for i, s in enumerate(p.iter_samples())]
    assert written.samples == len(expected) == 8
    assert written.tokens == store.num_tokens
    dataset = load_from_disk(str(out))
    assert sorted(dataset.column_names) == ["input_ids", "loss_mask", "seq_len"]
    index = [json.loads(line) for line in (out / SAMPLES_NAME).read_text().splitlines()]
    for row, (part, i, sample) in enumerate(expected):
        got = dataset[row]
        assert got["input_ids"].dtype == torch.int64 and got["loss_mask"].dtype == torch.int64
        assert got["input_ids"].tolist() == sample.input_ids.tolist()
        assert got["loss_mask"].tolist() == sample.loss_mask.int().tolist()
        assert int(got["seq_len"]) == len(sample)
        files = load_file(str(out / HIDDEN_DIR / f"hs_{row}.safetensors"))
        assert sorted(files) == ["hidden_states", "token_ids"]
        hs = files["hidden_states"]
        assert tuple(hs.shape) == (len(sample), LAYERS + 1, HIDDEN)
        assert torch.equal(hs[:, :LAYERS], sample.context)  # bit for bit, stored dtype
        assert torch.equal(hs[:, LAYERS], seeded_final(sample.input_ids))
        assert torch.equal(files["token_ids"], sample.input_ids.long())
        assert index[row] == {"row": row, "part": part, "sample": i,
                              "source_row": sample.source_row}


def test_the_agreement_reported_is_the_verifier_head_argmax_agreement(store_url, tmp_path):
    store = open_store(store_url)
    final = head_final(store)
    written = write_dataset(store_url, tmp_path / "right", final)
    assert written.agreement == pytest.approx(reference_agreement(store, final), abs=1e-9)
    assert written.agreement > 0.95
    # random states: which few tokens agree depends on every step of norm and head
    written = write_dataset(store_url, tmp_path / "random", seeded_final, min_agreement=0.0)
    assert written.agreement == pytest.approx(reference_agreement(store, seeded_final),
                                              abs=1e-9)


def test_a_final_layer_that_disagrees_with_the_stored_argmax_is_refused_and_nothing_left(
        store_url, tmp_path):
    out = tmp_path / "spec"
    with pytest.raises(StoreError, match=r"part 0 sample 0 \(source row 0\).*agrees with the "
                                         r"stored verifier argmax on \d+/\d+ tokens"):
        write_dataset(store_url, out, seeded_final)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_output_or_an_unfinished_store_is_refused(store_url, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(StoreError, match="already exists"):
        write_dataset(store_url, tmp_path / "taken", seeded_final, min_agreement=0.0)
    partial = str(tmp_path / "partial.zarr")
    build_store(partial, rows=8, parts=2, unfinished=1)
    with pytest.raises(StoreError, match=r"parts \[1\] are not complete"):
        write_dataset(partial, tmp_path / "spec", seeded_final, min_agreement=0.0)
    assert not (tmp_path / "spec").exists()


def test_speculators_numbers_layers_by_hidden_states_index():
    # ours: id k = output of decoder layer k = HF hidden_states[k + 1]
    assert speculators_layer_ids([1, 16, 31, 46, 61]) == [2, 17, 32, 47, 62]
