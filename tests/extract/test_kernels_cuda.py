"""On CUDA with fla installed, extract through fla's linear-attention kernels stores what the
torch reference path stores (within bf16 rounding), so a store's numbers do not depend on
which kernels the extraction machine happened to have. Skipped without CUDA or fla."""

import importlib.util
import subprocess
import sys

import pytest
import torch
from conftest import REPO, cli_args, cli_env, store_samples

from dflash_train.store_schema import open_store

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
    reason="needs CUDA and fla (the `cuda` extra)")

# A None entry in sys.modules makes `import fla` fail: transformers falls back to torch.
TORCH_PATH = ("import sys; sys.modules['fla'] = None; sys.modules['causal_conv1d'] = None; "
              "from dflash_train.extract.command import extract; extract()")
DEFAULT_PATH = "from dflash_train.extract.command import extract; extract()"


def _extract(code: str, model: str, data: str, out: str, dtype: str = "bfloat16") -> str:
    args = cli_args(model, data, out)
    args[args.index("--device") + 1] = "cuda"
    args[args.index("--dtype") + 1] = dtype
    done = subprocess.run([sys.executable, "-c", code, *args], env=cli_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_fla_kernels_store_what_the_torch_path_stores(qwen3_5_dir, chats_jsonl, tmp_path):
    """Both bf16 paths against the float32 torch path: fla's kernels may round differently
    from the torch path, but must not be further from the exact numbers than it is.

    (A first H200 run compared the two bf16 paths directly, with a fixed 3 % bound: they
    differed by 6.0 % on one sample of the random tiny model, with no reference to say which
    was off. This form was written after that run and has not yet run on CUDA.)"""
    paths = {"fla": (DEFAULT_PATH, "bfloat16"), "torch": (TORCH_PATH, "bfloat16"),
             "exact": (TORCH_PATH, "float32")}
    stores = {name: _extract(code, str(qwen3_5_dir), chats_jsonl, str(tmp_path / f"{name}.zarr"),
                             dtype) for name, (code, dtype) in paths.items()}
    kernels = {name: open_store(url).meta.created_with.kernels for name, url in stores.items()}
    assert "linear_attention=fla" in kernels["fla"], kernels
    assert "linear_attention=torch" in kernels["torch"], kernels
    fla, ref, exact = (store_samples(stores[n]) for n in ("fla", "torch", "exact"))
    err = {"fla": 0.0, "torch": 0.0}
    agree = {"fla": 0, "torch": 0}
    total = 0
    for a, b, e in zip(fla, ref, exact, strict=True):
        assert torch.equal(a.input_ids, e.input_ids) and torch.equal(a.loss_mask, e.loss_mask)
        truth = e.context.float()
        err["fla"] += float((a.context.float() - truth).norm() ** 2)
        err["torch"] += float((b.context.float() - truth).norm() ** 2)
        agree["fla"] += int((a.topk_ids[:, 0] == e.topk_ids[:, 0]).sum())
        agree["torch"] += int((b.topk_ids[:, 0] == e.topk_ids[:, 0]).sum())
        total += len(a)
    # squared error summed over every sample; 1.5x leaves room for rounding luck
    assert err["fla"] <= 1.5 * err["torch"], err
    # the verifier's top-1 (what acceptance is scored against) as often right as the torch path's
    assert agree["fla"] >= agree["torch"] - 0.03 * total, (agree, total)
