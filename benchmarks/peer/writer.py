"""One of our stores as speculators' offline training files, for its trainer to read.

    python -m benchmarks.peer.writer --store hs.zarr --model TARGET_DIR --out spec-data

Its format (speculators 0.9.0, `speculators train --data-path DIR`): DIR is a `datasets`
dataset saved with `save_to_disk`, one row per sample with `input_ids`, `loss_mask` and
`seq_len`, in torch format (int64 as read; `datasets` stores input_ids as int32 on its own,
as it does for speculators' own preprocessing); DIR/hidden_states/hs_{i}.safetensors holds row i's
`hidden_states` [L, n + 1, H] and `token_ids` [L] (== input_ids). The first n slices are the
context layers in ascending order; the last is the target's final decoder layer BEFORE the
final norm, from which its trainer makes its labels: argmax of lm_head(norm(last slice)).

Our stores hold only the context layers (extract refuses the last layer as one) and the
verifier's top-k, so that last slice is not in a store. `TargetFinalLayer` recomputes it: it
runs the store's own target (checked against the store's provenance) once per sample on the
stored tokens, with no generation. Every sample is then checked against the store: the
argmax of the store's frozen lm_head rows and final-norm scale applied to the recomputed
layer must agree with the stored verifier argmax, so a wrong layer, target or norm is
refused instead of written. Reads the store only through dflash_train.store_schema.

Layer ids differ by one: ours name the decoder layer whose output is taken (HF
hidden_states[k + 1]), speculators' the HF hidden_states index (vLLM's convention), so its
`--target-layer-ids` are ours + 1 (speculators' own z-lab converter does the same shift).
"""

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_train.dtypes import torch_dtype
from dflash_train.store_schema import Sample, Store, StoreError, open_store

HIDDEN_DIR = "hidden_states"
SAMPLES_NAME = "dflash_samples.jsonl"
"""Row i's part, sample and source row in the store it came from (ours; speculators ignores
it)."""
MIN_AGREEMENT = 0.95
"""Least share of tokens whose recomputed argmax must equal the stored one. Not 1: a batched
bf16 extract and a one-sample recompute round differently where two logits nearly tie."""
TOKEN_CHUNK = 256
"""Tokens per lm_head product in the agreement check (bounds its fp32 logits)."""

FinalLayer = Callable[[torch.Tensor], torch.Tensor]
"""input_ids int [L] -> the target's last decoder layer output [L, H], before the final norm."""


def speculators_layer_ids(context_layer_ids: list[int]) -> list[int]:
    """Our context layer ids in speculators' numbering (the HF hidden_states index)."""
    return [k + 1 for k in context_layer_ids]


def hidden_states(sample: Sample, final: torch.Tensor) -> torch.Tensor:
    """[L, n + 1, H]: the stored context layers, then the final pre-norm layer."""
    if tuple(final.shape) != (len(sample), sample.context.shape[2]):
        raise StoreError(f"final layer has shape {tuple(final.shape)}, expected "
                         f"{(len(sample), sample.context.shape[2])}")
    return torch.cat([sample.context, final.to(sample.context.dtype)[:, None]], dim=1)


@dataclass
class FrozenHead:
    """The store's frozen lm_head rows and final-norm scale: what speculators' verifier head
    computes from the last slice, rebuilt from the store to check it."""

    lm_head: torch.Tensor
    """[V, H] fp32."""
    norm_scale: torch.Tensor
    """[H] fp32: the norm's effective gain (1 + w for Qwen3.5's zero-centred norm)."""
    eps: float

    @classmethod
    def of(cls, store: Store) -> "FrozenHead":
        rows = store.target_rows()
        config = json.loads(store.read_files("target")["config.json"])
        eps = (config.get("text_config") or config).get("rms_norm_eps", 1e-6)
        return cls(rows["lm_head"].float(), rows["final_norm"].float(), float(eps))

    def argmax(self, final: torch.Tensor) -> torch.Tensor:
        """Next-token argmax [L] from final pre-norm states [L, H], lowest id on ties."""
        out = []
        for t0 in range(0, final.shape[0], TOKEN_CHUNK):
            x = final[t0:t0 + TOKEN_CHUNK].float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_scale
            out.append((x @ self.lm_head.T).argmax(-1))
        return torch.cat(out)


@dataclass
class Written:
    """What one conversion wrote."""

    out: str
    samples: int
    tokens: int
    agreement: float
    """Share of tokens whose recomputed argmax equals the stored verifier argmax."""
    target_layer_ids: list[int]
    """speculators' --target-layer-ids for these files."""
    dataset_bytes: int
    hidden_bytes: int


def samples_of(store: Store, limit: int | None = None
               ) -> Iterator[tuple[int, int, Sample]]:
    """(part index, sample index in the part, sample) of every committed sample, in order."""
    if store.unfinished_parts():
        raise StoreError(f"{store.url}: parts {store.unfinished_parts()} are not complete; "
                         "finish the extract (re-run it) before converting the store")
    seen = 0
    for part in store.parts():
        for i, sample in enumerate(part.iter_samples()):
            if limit is not None and seen >= limit:
                return
            yield part.index, i, sample
            seen += 1


def write_dataset(store_url: str, out: str | os.PathLike, final_layer: FinalLayer, *,
                  limit: int | None = None, min_agreement: float = MIN_AGREEMENT,
                  progress: Callable[[int], None] = lambda n: None) -> Written:
    """Convert the committed samples of `store_url` (the first `limit`) into `out`, a new
    directory, written whole or not at all."""
    from datasets import Dataset

    store = open_store(store_url)
    out = Path(out)
    if out.exists():
        raise StoreError(f"--out {out} already exists; pick a new directory")
    head = FrozenHead.of(store)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / HIDDEN_DIR).mkdir()
        rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
        agree = tokens = 0
        with open(tmp / SAMPLES_NAME, "w") as index:
            for i, (part, j, sample) in enumerate(samples_of(store, limit)):
                where = f"{store.url} part {part} sample {j} (source row {sample.source_row})"
                final = final_layer(sample.input_ids)
                if not torch.isfinite(final).all():
                    raise StoreError(f"{where}: the recomputed final layer holds NaN or Inf")
                same = int((head.argmax(final) == sample.topk_ids[:, 0].long()).sum())
                if same < min_agreement * len(sample):
                    raise StoreError(
                        f"{where}: the recomputed final layer's argmax agrees with the stored "
                        f"verifier argmax on {same}/{len(sample)} tokens; is --model the "
                        "store's target?")
                agree, tokens = agree + same, tokens + len(sample)
                ids = sample.input_ids.long()
                save_file({"hidden_states": hidden_states(sample, final).contiguous(),
                           "token_ids": ids.contiguous()},
                          str(tmp / HIDDEN_DIR / f"hs_{i}.safetensors"))
                # numpy, not lists: 16 bytes a token held until the dataset is written
                rows["input_ids"].append(ids.numpy())
                rows["loss_mask"].append(sample.loss_mask.long().numpy())
                rows["seq_len"].append(len(sample))
                index.write(json.dumps({"row": i, "part": part, "sample": j,
                                        "source_row": sample.source_row}) + "\n")
                progress(len(sample))
        if not rows["seq_len"]:
            raise StoreError(f"{store.url} holds no committed samples")
        dataset = Dataset.from_dict(rows)
        dataset.set_format(type="torch")
        dataset.save_to_disk(str(tmp))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Written(str(out), len(rows["seq_len"]), tokens, agree / tokens,
                   speculators_layer_ids(store.meta.context_layer_ids),
                   tree_bytes(out, exclude=HIDDEN_DIR), tree_bytes(out / HIDDEN_DIR))


def tree_bytes(root: Path, exclude: str | None = None) -> int:
    """Bytes of the files under `root` (apparent sizes), leaving out the subtree `exclude`."""
    total = 0
    for path in root.rglob("*"):
        if exclude and path.relative_to(root).parts[0] == exclude:
            continue
        if path.is_file():
            total += path.stat().st_size
    return total


class TargetFinalLayer:
    """The store's target, run on a sample's tokens, returning its last decoder layer's
    output before the final norm (a forward hook on that layer, as extract captures the
    context layers)."""

    def __init__(self, model: str, store: Store, *, device: str = "cpu",
                 load_as: str = "causal-lm"):
        from dflash_train.target_model.loading import load_target

        meta = store.meta
        self.target = load_target(model, device=device, dtype=torch_dtype(meta.hidden_dtype),
                                  load_as=load_as, progress=False)
        if self.target.info.config_sha256 != meta.target.config_sha256:
            raise StoreError(f"--model {model} is not the target of {store.url} (that is "
                             f"{meta.target.name_or_path}; their config hashes differ)")
        self.layer = meta.target.num_hidden_layers - 1

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        from dflash_train.target_model.capture import forward_states

        ids = input_ids.long()[None].to(self.target.device)
        context, _ = forward_states(self.target.decoder, [self.layer], ids,
                                    torch.ones_like(ids))
        return context[0, :, 0].cpu()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True, help="our store (path or URL)")
    ap.add_argument("--model", required=True,
                    help="the store's target (a local directory): recomputes the final layer")
    ap.add_argument("--out", required=True, help="new directory for speculators' files")
    ap.add_argument("--limit", type=int, default=None, help="convert only the first N samples")
    ap.add_argument("--device", default="cpu", help="torch device the target runs on")
    ap.add_argument("--load-as", default="causal-lm", choices=["causal-lm", "multimodal"],
                    help="load the target as its CausalLM or its multimodal wrapper")
    args = ap.parse_args()
    from tqdm import tqdm

    try:
        store = open_store(args.store)
        final = TargetFinalLayer(args.model, store, device=args.device, load_as=args.load_as)
        with tqdm(unit="tok", unit_scale=True, desc="store -> speculators") as bar:
            written = write_dataset(args.store, args.out, final, limit=args.limit,
                                    progress=bar.update)
    except StoreError as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(asdict(written), indent=2))


if __name__ == "__main__":
    main()
