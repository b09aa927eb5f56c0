"""The verifier directory speculators' trainer reads, made from the store alone.

`speculators train --verifier-name-or-path DIR` reads DIR/config.json (the drafter's shape,
its norm convention) and, from DIR's safetensors, only embed_tokens, lm_head and the final
norm weight (its frozen embedding and verifier head). A store holds exactly those (frozen
target rows) and the target's config.json, so this writes DIR from the store: the peer run
then needs no target files in HF layout (a GGUF target, a hub id not on disk).

The store keeps the final norm's EFFECTIVE gain (what multiplies the normalised state); a
checkpoint keeps the norm module's weight, which is gain - 1 for zero-centred norms
(Qwen3.5's `x * (1 + w)`). Which one the target uses is asked of transformers' own norm
class for the config (probed with a zero weight), not looked up in a list. speculators picks
its own norm convention by model type; `expected_head` is what launch.py checks its built
verifier head against before training, so a convention mismatch stops the run.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_train.store_schema import Store, StoreError

EXPECTED_HEAD = "dflash-expected-head.safetensors"
"""In the verifier directory: the store's lm_head rows and final-norm gain, fp32."""


def zero_centred_norm(config: dict) -> bool:
    """Whether the target's final norm computes x * (1 + w) (else x * w), asked of the norm
    class transformers builds for this config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    text = config.get("text_config") or config
    cfg = AutoConfig.for_model(**text)
    with torch.device("meta"):
        norm_cls = type(AutoModelForCausalLM.from_config(cfg).model.norm)
    norm = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
    with torch.no_grad():
        norm.weight.zero_()
        out = norm(torch.full((1, cfg.hidden_size), 1e3)).float()
    if torch.allclose(out, torch.ones_like(out)):
        return True
    if torch.allclose(out, torch.zeros_like(out)):
        return False
    raise StoreError(f"{norm_cls.__name__}: neither x * w nor x * (1 + w); cannot write its "
                     "weight from the stored gain")


def write_verifier(store: Store, out: str | Path) -> Path:
    """DIR for speculators' --verifier-name-or-path, from the store's rows and config."""
    out = Path(out)
    if out.exists():
        raise StoreError(f"{out} already exists; pick a new directory")
    config = json.loads(store.read_files("target")["config.json"])
    rows = store.target_rows()
    gain = rows["final_norm"].float()
    weight = gain - 1 if zero_centred_norm(config) else gain
    out.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": rows["embed_tokens"].contiguous(),
               "lm_head.weight": rows["lm_head"].contiguous(),
               "model.norm.weight": weight.to(rows["lm_head"].dtype).contiguous()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({"lm_head": rows["lm_head"].float().contiguous(), "final_norm": gain},
              str(out / EXPECTED_HEAD))
    return out
