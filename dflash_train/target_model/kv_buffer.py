"""A generation cache whose attention keys and values are written into buffers sized once.

transformers' DynamicCache grows every full-attention layer by `torch.cat` at each decoding
step, copying the whole cache: on SmolLM2 regeneration (30 layers, batches of 20-60 rows) that
copy took ~38 % of the time. Here each such layer gets one buffer for the whole generation
(prompt width + new tokens) and returns views of its filled part: the attention sees the same
keys and values in the same order, so what it computes is unchanged. Other layer kinds (the
hybrid's linear-attention states, sliding windows) stay as transformers builds them.
"""

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class BufferedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in buffers of `capacity` positions."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.filled = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        self.device = key_states.device
        self._keys = key_states.new_empty(batch, heads, self.capacity, key_states.shape[-1])
        self._values = value_states.new_empty(batch, value_states.shape[1], self.capacity,
                                              value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.filled + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"generation cache: {end} positions past the {self.capacity} "
                               "it was sized for")
        self._keys[:, :, self.filled:end] = key_states
        self._values[:, :, self.filled:end] = value_states
        self.filled = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def reset(self) -> None:
        self.filled = 0
        super().reset()  # the buffers go with the keys: the next update sizes them again

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove positions (DynamicLayer's convention)."""
        if tokens_to_remove >= 0 or not self.is_initialized:
            return super().crop(tokens_to_remove)  # refuses a positive count
        self.filled = max(0, self.filled + tokens_to_remove)
        self.keys = self._keys[:, :, :self.filled]
        self.values = self._values[:, :, :self.filled]

    def _unsupported(self, *args, **kwargs) -> None:
        raise NotImplementedError("a buffered generation cache holds one batch's rows "
                                  "(greedy or sampled decoding, no beams)")

    batch_repeat_interleave = batch_select_indices = reorder_cache = _unsupported


def buffered_cache(model: torch.nn.Module, capacity: int) -> DynamicCache | None:
    """transformers' DynamicCache for `model` with every plain full-attention layer replaced by
    a BufferedLayer of `capacity` positions (prompt width + tokens the generation feeds); None
    (generate's own choice) where the model's generation config names a cache implementation,
    which generate refuses beside a cache passed in."""
    if getattr(model.generation_config, "cache_implementation", None) is not None:
        return None
    cache = DynamicCache(config=model.config)
    cache.layers = [BufferedLayer(capacity) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache
