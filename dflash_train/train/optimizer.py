"""Which optimiser steps which drafter parameter: AdamW for all (the default), or Muon for the
2-D weight matrices and AdamW for the rest (norms), as speculators does.

Either way the loop gets ONE torch Optimizer: one param_groups list for the LR schedule to
drive, one state_dict for the checkpoint and for the FSDP state-dict helpers. AdamW is torch's;
`Muon` is torch's Muon (its constructor, groups and state) with our step, which runs the
Newton-Schulz orthogonalisation in float32 where bf16 is emulated (torch's casts every gradient
to bf16: on an AVX2-only CPU a SmolLM2 step took 32 s against AdamW's 1.4-1.8 s). Where bf16 is
native the step is torch's, to the bit. Under DDP every rank holds the same gradients, so each
orthogonalises only its share of the matrices and takes the rest from their owners (a
broadcast): from equal gradients, the bits one process would compute, without every rank
repeating the whole iteration.
`MuonWithAdamW` lets both step over shared groups/state.
"""

import math

import torch
import torch.distributed as dist

from dflash_train.devices import native_bf16
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


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, *, ranks: int = 1,
                    rank: int = 0) -> torch.optim.Optimizer:
    """The optimiser `cfg.optimizer` names over `model`'s trainable parameters. `ranks` > 1:
    DDP's ranks (gradients equal on all, in the default process group), among which Muon
    shares out its Newton-Schulz iterations; this process is `rank`."""
    adamw = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), **adamw)
    matrices, others = muon_split(model)
    if not matrices:
        raise TrainError("optim.optimizer muon: the drafter has no 2-D weight matrix to give "
                         "Muon; use optim.optimizer=adamw")
    muon = Muon(
        matrices, ns_dtype=newton_schulz_dtype(matrices[0].device),
        lr=cfg.muon_lr if cfg.muon_lr is not None else cfg.lr,
        weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr_fn, ranks=ranks, rank=rank)
    return MuonWithAdamW(muon, torch.optim.AdamW(others, **adamw) if others else None)


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bf16 where `device` runs bf16 matmuls natively (torch's choice, kept there), else
    float32: emulated bf16 GEMMs run ~50x slower than float32 ones."""
    return torch.bfloat16 if native_bf16(device) else torch.float32


def orthogonalise(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz iteration towards U V^T of `update` = U S V^T,
    computed in `dtype` on a copy (the momentum buffer may be `update` itself).

    X <- update / ||update||_F (wide side last, so the Gram matrix is the small one); then
    `steps` times: A = X X^T, X <- a X + (b A + c A^2) X. The same ops in the same order as
    torch 2.13's `_zeropower_via_newtonschulz`, so dtype=bfloat16 gives its bits."""
    x = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def newton_schulz_owners(shapes: list[torch.Size], ranks: int) -> list[int]:
    """The rank that orthogonalises each matrix: the dearest first, each to the least loaded
    rank so far (an iteration costs ~ 4 m^2 n + 2 m^3 for m <= n); a function of the shapes
    alone, so every rank computes the same answer."""
    def cost(shape: torch.Size) -> int:
        m, n = sorted(shape[:2])
        return 4 * m * m * n + 2 * m ** 3

    load, owners = [0] * ranks, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-cost(shapes[i]), i)):
        owners[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[i]] += cost(shapes[i])
    return owners


def _adjusted_lr(lr: float, rule: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix LR scale: "original" (Keller's, sqrt(max(1, rows / cols))) or
    "match_rms_adamw" (Moonshot's, 0.2 sqrt(max(rows, cols)): AdamW's update RMS)."""
    rows, cols = shape[:2]
    if rule == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))  # torch's rounding order
    return lr * math.sqrt(max(1, rows / cols)) if rule in (None, "original") else lr


def _loss_of(closure) -> torch.Tensor | None:
    """What torch's optimisers do with a step's closure: re-evaluate the loss with grads on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Muon(torch.optim.Muon):
    """torch's Muon (same arguments, checks, groups and state_dict) whose step orthogonalises
    in `ns_dtype`: float32 where bf16 is emulated. Kept off the param groups so a checkpoint
    from either machine kind loads on the other."""

    def __init__(self, params, ns_dtype: torch.dtype, ranks: int = 1, rank: int = 0,
                 **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype, self.ranks, self.rank = ns_dtype, ranks, rank

    @torch.no_grad()
    def step(self, closure=None):
        """torch's single-tensor Muon update of every matrix with a gradient: momentum
        (Nesterov or not), orthogonalised update, decoupled weight decay, then the
        shape-adjusted LR step. One process applies each update as it comes; DDP's ranks
        first iterate all of their own matrices (so that the ranks compute side by side),
        then broadcast and apply the updates one by one."""
        loss = _loss_of(closure)
        work = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        owners = newton_schulz_owners([p.shape for p, _ in work], self.ranks)
        mine = {}
        for i, ((p, group), owner) in enumerate(zip(work, owners, strict=True)):
            buf = self._folded_momentum(p, group)  # every rank: the buffers stay equal
            if owner != self.rank:
                continue
            update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            update = orthogonalise(update, group["ns_coefficients"], group["ns_steps"],
                                   group["eps"], self.ns_dtype)  # a copy: `buf` stays
            if self.ranks == 1:
                _apply(p, group, update)
            else:
                mine[i] = update
        if self.ranks > 1:
            for i, ((p, group), owner) in enumerate(zip(work, owners, strict=True)):
                _apply(p, group, _from_owner(mine.pop(i, None), p, owner))
        return loss

    def _folded_momentum(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """`p`'s momentum buffer with its gradient folded in."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        return state["momentum_buffer"].lerp_(p.grad, 1 - group["momentum"])


def _apply(p: torch.Tensor, group: dict, update: torch.Tensor) -> None:
    """Decoupled weight decay, then the shape-adjusted LR step."""
    lr = float(group["lr"])
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(update, alpha=-_adjusted_lr(lr, group["adjust_lr_fn"], p.shape))


def _from_owner(update: torch.Tensor | None, p: torch.Tensor, owner: int) -> torch.Tensor:
    """`p`'s orthogonalised update, broadcast by its owner (`update` there, None elsewhere)
    through a fresh float32 buffer of `p`'s shape on every rank: a broadcast sends storage
    order, and a tall matrix's update is a transposed view (in float32, `.to` would hand
    that view back uncopied); float32 is gloo's surest dtype, a bf16 update widens exactly,
    and adding it to the float32 weight widens it anyway."""
    buffer = torch.empty(p.shape, dtype=torch.float32, device=p.device)
    if update is not None:
        buffer.copy_(update)
    dist.broadcast(buffer, src=owner)
    return buffer


class MuonWithAdamW(torch.optim.Optimizer):
    """A Muon and an AdamW over disjoint parameters, as one optimiser.

    Its param_groups are AdamW's then Muon's, each tagged with "optimizer"; the two inner
    optimisers step over exactly those group dicts and this object's state, so an LR
    scheduler's writes reach them and state_dict / load_state_dict cover both. Loading
    replaces the group dicts and the state, so the inner optimisers are linked again after."""

    def __init__(self, muon: Muon, adamw: torch.optim.AdamW | None) -> None:
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
        loss = _loss_of(closure)
        for opt in self._inner.values():
            if opt is not None:
                opt.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()
