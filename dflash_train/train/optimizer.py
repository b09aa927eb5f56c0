"""Which optimiser steps which drafter parameter: AdamW for all (the default), or torch's Muon
for the 2-D weight matrices and AdamW for the rest (norms), as speculators does.

Either way the loop gets ONE torch Optimizer: one param_groups list for the LR schedule to
drive, one state_dict for the checkpoint and for the FSDP state-dict helpers. Muon and AdamW
stay torch's own classes; `MuonWithAdamW` only lets both step over its shared groups and state.
"""

import torch

from dflash_train.train.config import OptimConfig
from dflash_train.train.errors import TrainError

ADAMW_NAMES = ("embed_tokens", "lm_head", "codebook")
"""2-D parameters left to AdamW by name: embedding-like rows, not hidden-layer matrices (Muon
practice). The drafter borrows the target's frozen embedding and head; DFlash 2's free
selector codebooks are [V, r] tables looked up by token id, so they are rows too (their
factorised form's [H, r] factors are matrices and go to Muon)."""


def muon_split(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(matrices for Muon, the rest for AdamW) among the trainable parameters, in model order.
    A matrix is 2-D with both sides > 1 and not named like an embedding or output head."""
    matrices, others = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = p.ndim == 2 and min(p.shape) > 1 and not any(n in name for n in ADAMW_NAMES)
        (matrices if is_matrix else others).append(p)
    return matrices, others


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimiser `cfg.optimizer` names over `model`'s trainable parameters."""
    adamw = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), **adamw)
    matrices, others = muon_split(model)
    if not matrices:
        raise TrainError("optim.optimizer muon: the drafter has no 2-D weight matrix to give "
                         "Muon; use optim.optimizer=adamw")
    muon = torch.optim.Muon(
        matrices, lr=cfg.muon_lr if cfg.muon_lr is not None else cfg.lr,
        weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr_fn)
    return MuonWithAdamW(muon, torch.optim.AdamW(others, **adamw) if others else None)


class MuonWithAdamW(torch.optim.Optimizer):
    """A Muon and an AdamW over disjoint parameters, as one optimiser.

    Its param_groups are AdamW's then Muon's, each tagged with "optimizer"; the two inner
    optimisers step over exactly those group dicts and this object's state, so an LR
    scheduler's writes reach them and state_dict / load_state_dict cover both. Loading
    replaces the group dicts and the state, so the inner optimisers are linked again after."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW | None) -> None:
        self._inner = {"adamw": adamw, "muon": muon}
        groups = [{**g, "optimizer": kind} for kind, opt in self._inner.items()
                  if opt is not None for g in opt.param_groups]
        super().__init__(groups, defaults={})
        self._link()

    def _link(self) -> None:
        for kind, opt in self._inner.items():
            if opt is not None:
                opt.param_groups = [g for g in self.param_groups if g["optimizer"] == kind]
                opt.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self._inner.values():
            if opt is not None:
                opt.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()
