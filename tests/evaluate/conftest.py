"""Tiny stores and drafters for the eval tests, all built in-process.

- `save_eos_target`: the tiny Qwen3 of dflash_train.assets.tiny with its EOS row of lm_head tied
  to a common token's (x1.1), so greedy generations end both by EOS and by max_new_tokens.
- `regen_store`: `extract --regenerate` of that target in float32 on CPU (the store whose
  offline replay must equal live decoding).
- `trained_drafter_dir`: a 2-layer drafter fitted for a few seconds on that store, so that
  acceptance is far from trivial (streaks of many lengths) and the equality test has teeth.
- `hybrid_store` / `hybrid_drafter_dir`: the same for the Qwen3.5 hybrid (linear attention).
- `write_synthetic_store`: a one-part store of hand-made samples (no model at all).
"""

import pytest
import torch
import torch.nn.functional as F

from dflash_train.assets.tiny import VOCAB_SIZE, make_chats, save_qwen3, save_qwen3_5, write_jsonl
from dflash_train.blocks import block_labels, eligible_anchors
from dflash_train.drafter import DFlashDrafter, DrafterConfig, build_block_ids, save_drafter
from dflash_train.store_schema import Sample, StoreMeta, create_store, open_store
from dflash_train.train.drafter_shape import most_frequent_labels
from tests.extract.conftest import run_extract_cfg
from tests.store_factory import store_meta

EOS_ID = 3
EOS_LIKE = 293
"""A token the tiny target generates often; EOS's lm_head row becomes 1.1 x its row."""
MASK_ID = 4
LAYERS = [0, 1, 2]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """These models are tiny: on a shared 2-core machine a second intra-op thread only
    spins against other processes (measured 4x slower per op under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save_eos_target(path, **overrides) -> str:
    from transformers import AutoModelForCausalLM

    save_qwen3(path, **overrides)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight[EOS_ID] = model.lm_head.weight[EOS_LIKE] * 1.1
    model.save_pretrained(path)
    return str(path)


def drafter_config(**overrides) -> DrafterConfig:
    fields = dict(hidden_size=64, vocab_size=VOCAB_SIZE, intermediate_size=128,
                  target_layer_ids=LAYERS, num_target_layers=4, mask_token_id=MASK_ID,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, block_size=8)
    fields.update(overrides)
    return DrafterConfig(**fields)


def random_drafter(seed: int = 0, **overrides) -> DFlashDrafter:
    """HF's final-norm init (not the default 1/sqrt(hidden)): the drafters, and so the
    reports recorded in golden/, those the eval tests were written against."""
    torch.manual_seed(seed)
    return DFlashDrafter(drafter_config(**overrides), final_norm_init="ones")


def mapped_drafter(store_url: str, draft_vocab_size: int, seed: int = 0, **overrides
                   ) -> DFlashDrafter:
    """A random drafter over the store's `draft_vocab_size` most frequent labels."""
    model = random_drafter(seed, draft_vocab_size=draft_vocab_size, **overrides)
    ids, _ = most_frequent_labels([open_store(store_url)], draft_vocab_size)
    model.set_draft_vocab(ids)
    return model


def fit_drafter(model: DFlashDrafter, store_url: str, steps: int, lr: float = 3e-3
                ) -> DFlashDrafter:
    """Full-batch Adam on every eligible block of the store (memorises it: a drafter with
    real, varied acceptance on that store)."""
    store = open_store(store_url)
    rows = store.target_rows()
    model.attach_target_head(rows["embed_tokens"].float(), rows["lm_head"].float())
    samples = [s for p in store.parts() for s in p.iter_samples()]
    samples = [s for s in samples if eligible_anchors(s.loss_mask).numel()]
    b = model.config.block_size
    width = max(len(s) for s in samples)
    most = max(eligible_anchors(s.loss_mask).numel() for s in samples)
    context = torch.zeros(len(samples), width, len(LAYERS), 64)
    anchors = torch.ones(len(samples), most, dtype=torch.long)  # padding blocks: anchor 1 ...
    labels = torch.full((len(samples), most, b), -100)  # ... and no label
    for r, s in enumerate(samples):
        a = eligible_anchors(s.loss_mask)
        context[r, : len(s)] = s.context.float()
        anchors[r, : a.numel()] = a
        labels[r, : a.numel()] = block_labels(s.topk_ids, s.loss_mask, a, b)[0]
    labels = model.to_draft_labels(labels)  # over a draft vocabulary: its ids
    ids = torch.stack([build_block_ids(s.input_ids.long()[a], MASK_ID, b)
                       for s, a in zip(samples, anchors, strict=True)])
    lengths = torch.tensor([len(s) for s in samples])
    model.requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        logits = model.forward_logits(context, lengths, ids, anchors)
        F.cross_entropy(logits.flatten(0, 2), labels.flatten(), ignore_index=-100).backward()
        opt.step()
    return model.requires_grad_(False)


def regenerated_store(tmp_path_factory, name: str, target: str, rows: int, new_tokens: int):
    """`extract --regenerate` of `rows` chats by `target` into a fresh `<name>.zarr`."""
    tmp = tmp_path_factory.mktemp(name)
    data = write_jsonl(tmp / "chats.jsonl", make_chats(rows))
    out = str(tmp / f"{name}.zarr")
    run_extract_cfg(target, data, out, regenerate=True, max_new_tokens=new_tokens,
                    layers=",".join(map(str, LAYERS)))
    return out


@pytest.fixture(scope="session")
def eos_target_dir(tmp_path_factory) -> str:
    return save_eos_target(tmp_path_factory.mktemp("eos_target"))


@pytest.fixture(scope="session")
def regen_store(tmp_path_factory, eos_target_dir) -> str:
    return regenerated_store(tmp_path_factory, "regen", eos_target_dir, 12, MAX_NEW_TOKENS)


def fitted_drafter_dir(tmp_path_factory, store_url: str, steps: int, name: str) -> str:
    # Runs under one_torch_thread: the fit, hence the drafter, is the same on every run.
    model = fit_drafter(random_drafter(seed=1), store_url, steps=steps)
    return str(save_drafter(model, tmp_path_factory.mktemp(name) / name))


@pytest.fixture(scope="session")
def trained_drafter_dir(tmp_path_factory, regen_store) -> str:
    return fitted_drafter_dir(tmp_path_factory, regen_store, 60, "trained")


@pytest.fixture(scope="session")
def hybrid_target_dir(tmp_path_factory) -> str:
    return save_qwen3_5(tmp_path_factory.mktemp("hybrid_target"))


@pytest.fixture(scope="session")
def hybrid_store(tmp_path_factory, hybrid_target_dir) -> str:
    """`extract --regenerate` of the Qwen3.5 hybrid (linear attention x 3, full x 1)."""
    return regenerated_store(tmp_path_factory, "hybrid", hybrid_target_dir, 8, 24)


@pytest.fixture(scope="session")
def hybrid_drafter_dir(tmp_path_factory, hybrid_store) -> str:
    # 25 steps: partly fitted, so streaks spread over 0..7 rather than all 0 or all 7.
    return fitted_drafter_dir(tmp_path_factory, hybrid_store, 25, "hybrid_drafter")


@pytest.fixture(scope="session")
def random_drafter_dir(tmp_path_factory) -> str:
    return str(save_drafter(random_drafter(seed=2), tmp_path_factory.mktemp("rand") / "rand"))


def synthetic_meta(*, regenerated: bool, name: str = "tiny-target", num_layers: int = 4,
                   layers: list[int] = LAYERS, top_k: int = 4) -> StoreMeta:
    return store_meta(
        target={"name_or_path": name, "model_type": "qwen3", "num_hidden_layers": num_layers,
                "hidden_size": 64, "vocab_size": VOCAB_SIZE},
        source={"paths": ["synthetic"], "regenerated": regenerated},
        created_with={"kernels": "-"},
        context_layer_ids=list(layers), top_k=top_k, hidden_dtype="float32", num_parts=1)


def synthetic_sample(input_ids: list[int], loss_mask: list[bool], top1: list[int], row: int,
                     gen: torch.Generator, n_layers: int = len(LAYERS)) -> Sample:
    length = len(input_ids)
    top = torch.tensor(top1, dtype=torch.int32)
    others = (top[:, None] + torch.arange(1, 4)[None]) % VOCAB_SIZE
    logits = torch.tensor([5.0, 1.0, 0.5, 0.0]).expand(length, 4).contiguous()
    return Sample(
        input_ids=torch.tensor(input_ids, dtype=torch.int32),
        loss_mask=torch.tensor(loss_mask, dtype=torch.bool),
        context=torch.randn(length, n_layers, 64, generator=gen),
        topk_ids=torch.cat([top[:, None], others.int()], dim=1),
        topk_logits=logits, lse=logits[:, 0] + 0.5, source_row=row)


def write_synthetic_store(url: str, samples: list[Sample], *, regenerated: bool,
                          **meta) -> str:
    """A one-part float32 store with random target rows."""
    store = create_store(url, synthetic_meta(regenerated=regenerated, **meta), shard_tokens=64)
    gen = torch.Generator().manual_seed(7)
    store.write_target_rows(torch.randn(VOCAB_SIZE, 64, generator=gen),
                            torch.randn(VOCAB_SIZE, 64, generator=gen), torch.ones(64))
    writer = store.part_writer(0, 0, 1000)
    for s in samples:
        writer.append(s)
    writer.finish()
    return url
