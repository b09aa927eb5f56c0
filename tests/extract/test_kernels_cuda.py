"""On CUDA with fla installed, extract through fla's linear-attention kernels stores what the
torch reference path stores (within bf16 rounding), so a store's numbers do not depend on
which kernels the extraction machine happened to have. Skipped without CUDA or fla."""

import importlib.util
import subprocess
import sys

import pytest
import torch
from conftest import REPO, cli_args, cli_env, store_samples

from dflash.store_schema import open_store

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
    reason="needs CUDA and fla (the `cuda` extra)")

# A None entry in sys.modules makes `import fla` fail: transformers falls back to torch.
TORCH_PATH = ("import sys; sys.modules['fla'] = None; sys.modules['causal_conv1d'] = None; "
              "from dflash.extract.command import extract; extract()")
DEFAULT_PATH = "from dflash.extract.command import extract; extract()"


def _extract(code: str, model: str, data: str, out: str) -> str:
    args = cli_args(model, data, out)
    args[args.index("--device") + 1] = "cuda"
    args[args.index("--dtype") + 1] = "bfloat16"
    done = subprocess.run([sys.executable, "-c", code, *args], env=cli_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_fla_kernels_store_what_the_torch_path_stores(qwen3_5_dir, chats_jsonl, tmp_path):
    fla = store_samples(_extract(DEFAULT_PATH, str(qwen3_5_dir), chats_jsonl,
                                 str(tmp_path / "fla.zarr")))
    ref = store_samples(_extract(TORCH_PATH, str(qwen3_5_dir), chats_jsonl,
                                 str(tmp_path / "torch.zarr")))
    kernels = {name: open_store(str(tmp_path / f"{name}.zarr")).meta.created_with.kernels
               for name in ("fla", "torch")}
    assert "linear_attention=fla" in kernels["fla"], kernels
    assert "linear_attention=torch" in kernels["torch"], kernels
    agree = total = 0
    for a, b in zip(fla, ref, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        x, y = a.context.float(), b.context.float()
        # bf16 keeps 8 mantissa bits; a few roundings through the layers stay within ~3 %
        assert (x - y).norm() <= 0.03 * y.norm(), a.source_row
        agree += int((a.topk_ids[:, 0] == b.topk_ids[:, 0]).sum())
        total += len(a)
    assert agree >= 0.98 * total, (agree, total)
