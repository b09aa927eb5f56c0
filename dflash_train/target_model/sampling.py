"""The target's next token at temperature T > 0, drawn reproducibly by keyed Gumbel-max.

Math. For logits z over the vocabulary and G_v independent standard Gumbel variables,
argmax_v (z_v / T + G_v) is distributed as softmax(z / T) (the Gumbel-max trick). Top-k and
top-p restrict the support first, in that order, as masks: a removed token's z_v / T becomes
-inf, so the argmax never returns it and the rest keep their renormalized probabilities.
Top-k keeps the k largest (ties with the k-th included); top-p then keeps, of softmax over what
top-k left, the most probable tokens up to the first whose cumulative mass reaches top_p.

Contract. The noise G of one token is a pure function of (seed, sample id, absolute position,
token id): a counter-based integer hash, no generator state. The token drawn at a position
therefore depends only on the logits there and that key: not on the batch or row it sits in,
the padding around it, how many draws came before, or which call made them. Plain sampled
generation and speculative decoding that keeps a draft while it equals the target's draw
(sample-and-match) then commit the same tokens for the same seed (docs/reference.md §8a).
T = 0 is plain argmax, bit for bit. Nothing here touches a model or a global generator.

Construction. Everything is exact integer arithmetic on 32-bit values held in int64 lanes (no
signed overflow, so CPU and CUDA give the same bits): the key folds seed, sample id and position
through MurmurHash3's 32-bit finalizer (fmix32) one at a time; each token's 32 bits are fmix32 of
the key xor fmix32 of the token id. The top 23 bits k give the uniform u = (2k + 1) / 2^24,
exact in float32 and strictly inside (0, 1); G = -log(-log u) in float32, so G lies in
[-2.80, 16.64]. The uniform's bits are identical on every device; the float32 logs may differ
by an ulp between CPU and CUDA, far below the logit differences between kernels. Under a top-k
or top-p mask only the kept tokens' noise is computed (the same ops on the same keys, so the
same bits): top-k 20 of a 152K vocabulary hashes 20 tokens a row, not 152K.
"""

import hashlib
from dataclasses import dataclass

import torch

from dflash_train.target_model.errors import TargetError

_MASK32 = 0xFFFFFFFF
_FMIX_C1, _FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35  # MurmurHash3 fmix32's multipliers
_TOKEN_SALT = 0x9E3779B9  # keeps token 0's hash apart from the key's own
_UNIFORM_BITS = 23  # 2k + 1 < 2^24: exact in float32's 24-bit significand
KEY_LIMIT = 1 << 32
"""Seeds must lie below this; sample ids and positions are taken modulo it."""


@dataclass(frozen=True)
class SamplingConfig:
    """How the target draws its next token."""

    temperature: float = 0.0
    """Divides the logits before the draw; 0: greedy (argmax), the other fields unused."""
    top_p: float = 1.0
    """Nucleus: keep the most probable tokens up to the first whose cumulative probability
    reaches top_p (after top-k); 1: off."""
    top_k: int = 0
    """Keep only the k largest logits (ties with the k-th kept); 0: off."""
    seed: int = 0
    """Keys the noise with the sample id and position: the same seed draws the same tokens
    whatever the batching or decoding loop. 0 <= seed < 2^32."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature != float("inf")):
            raise TargetError(f"temperature {self.temperature} must be finite and >= 0")
        if not 0 < self.top_p <= 1:
            raise TargetError(f"top_p {self.top_p} must lie in (0, 1]")
        if self.top_k < 0:
            raise TargetError(f"top_k {self.top_k} must be >= 0 (0: off)")
        if not 0 <= self.seed < KEY_LIMIT:
            raise TargetError(f"seed {self.seed} must lie in [0, 2^32)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingConfig()
"""Temperature 0: argmax, today's decoding everywhere."""


def _mul32_(x: torch.Tensor, c: int, tmp: torch.Tensor) -> None:
    """x = x * c mod 2^32 for x in [0, 2^32), in place: c split in 16-bit halves keeps every
    product below 2^49."""
    torch.mul(x, c >> 16, out=tmp)
    tmp.bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    x.mul_(c & 0xFFFF).add_(tmp).bitwise_and_(_MASK32)


def _fmix32_(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finalizer, in place (a [rows, V] step is memory-bound: fresh tensors per
    op cost 3.5x on CPU): a bijection of [0, 2^32) whose every output bit depends on every
    input bit. Right shifts are logical here because x is never negative."""
    tmp = torch.empty_like(x)
    for shift, c in ((16, _FMIX_C1), (13, _FMIX_C2), (16, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        x.bitwise_xor_(tmp)
        if c is not None:
            _mul32_(x, c, tmp)
    return x


def _as_keys(values, rows: int, device: torch.device, name: str) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.long, device=device).reshape(-1)
    if t.numel() != rows:
        raise TargetError(f"{name} has {t.numel()} entries for {rows} rows")
    return t & _MASK32


def _row_keys(seed: int, sample_ids, positions, device: torch.device) -> torch.Tensor:
    """Each row's key, folded from (seed, sample id, position): int64 [rows]."""
    rows = torch.as_tensor(sample_ids).numel()
    sample = _as_keys(sample_ids, rows, device, "sample_ids")
    pos = _as_keys(positions, rows, device, "positions")
    key = _fmix32_(torch.full((rows,), seed & _MASK32, dtype=torch.long, device=device))
    return _fmix32_(_fmix32_(key ^ sample) ^ pos)


def _token_hashes(ids: torch.Tensor) -> torch.Tensor:
    return _fmix32_(ids ^ _TOKEN_SALT)


def _keyed_bits(seed: int, sample_ids, positions, vocab_size: int,
                device: torch.device) -> torch.Tensor:
    """The 32 hashed bits of every (row key, token id), int64 [rows, vocab_size]."""
    key = _row_keys(seed, sample_ids, positions, device)
    token = _token_hashes(torch.arange(vocab_size, dtype=torch.long, device=device))
    return _fmix32_(key[:, None] ^ token[None, :])


def _gumbel_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel float32 of hashed bits (module docstring), consuming `bits`."""
    bits.bitwise_right_shift_(32 - _UNIFORM_BITS).mul_(2).add_(1)
    u = bits.to(torch.float32).mul_(2.0 ** -(_UNIFORM_BITS + 1))
    return u.log_().neg_().log_().neg_()


def gumbel_noise(seed: int, sample_ids, positions, vocab_size: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel noise float32 [rows, vocab_size], row r keyed by (seed, sample_ids[r],
    positions[r]) and column v by the token id: a pure function of those four numbers."""
    return _gumbel_of_bits(_keyed_bits(seed, sample_ids, positions, vocab_size,
                                       torch.device(device)))


def _gumbel_at(seed: int, sample_ids, positions, rows: torch.Tensor,
               cols: torch.Tensor) -> torch.Tensor:
    """gumbel_noise's values at the pairs (rows[i], cols[i]) only, float32 [n]: the same
    integer ops on the same (row key, token id), so the same bits."""
    key = _row_keys(seed, sample_ids, positions, rows.device)
    return _gumbel_of_bits(_fmix32_(key[rows] ^ _token_hashes(cols)))


def sampling_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """float32 logits / T with the tokens top-k and top-p remove set to -inf ([rows, V])."""
    scaled = logits.float() / cfg.temperature
    if 0 < cfg.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, cfg.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if cfg.top_p < 1:
        probs = torch.softmax(scaled, dim=-1)
        # stable: equal probabilities keep id order, so the cut is the same on every run
        ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(ordered, dim=-1) - ordered  # mass of the more probable tokens
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before >= cfg.top_p)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def perturbed_logits(logits: torch.Tensor, cfg: SamplingConfig, sample_ids,
                     positions) -> torch.Tensor:
    """sampling_logits + the keyed Gumbel noise of each row's (sample id, position): its argmax
    is the sample. What a decoding loop that picks by argmax (HF generate with do_sample off, a
    verify step) needs in place of the logits. `positions` are where the drawn tokens will
    sit: absolute positions in their own sequence, prompt counted, padding not."""
    scaled = sampling_logits(logits, cfg)
    vocab = scaled.shape[-1]
    if 0 < cfg.top_k < vocab or cfg.top_p < 1:
        # A token top-k / top-p removed is -inf whatever its noise: hash only the kept ones
        # (top-k 20 of a 152K vocab: 20 tokens, not 152K). Any non-finite value is unchanged
        # by a finite noise, so skipping those too keeps every element's bits.
        rows, cols = torch.isfinite(scaled).nonzero(as_tuple=True)
        if 2 * rows.numel() < scaled.numel():
            scaled[rows, cols] += _gumbel_at(cfg.seed, sample_ids, positions, rows, cols)
            return scaled
    return scaled + gumbel_noise(cfg.seed, sample_ids, positions, vocab, logits.device)


SEED_LIMIT = 2**31
"""A server's request seeds lie below this: vLLM takes any int, llama.cpp a uint32 whose
0xFFFFFFFF means "random"; 31 bits suit both."""


def request_seed(seed: int, source_row: int) -> int:
    """The seed of one sampled request to a server (extract --server, eval --served): the run's
    seed and the prompt's source row hashed together (BLAKE2b), so each prompt draws its own
    stream and a rerun draws the same one. The server's stream, not our keyed noise: its draws
    are samples of the same law, never the same tokens."""
    key = f"{seed}/{source_row}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") % SEED_LIMIT


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, sample_ids=None,
                positions=None) -> torch.Tensor:
    """The next token of every row of `logits` [rows, V] (long [rows]): argmax at T = 0
    (ids and positions unused), else the keyed Gumbel-max draw (module docstring)."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    if sample_ids is None or positions is None:
        raise TargetError("sampling at temperature > 0 needs sample_ids and positions")
    return perturbed_logits(logits, cfg, sample_ids, positions).argmax(dim=-1)
