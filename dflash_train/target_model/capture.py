"""One forward of the target's decoder that keeps only the selected layers' outputs.

Owns hooking the decoder layers and running the padded batch. Forward hooks copy the chosen
layers' outputs as they are produced, so the other layers' states are freed as usual (never
`output_hidden_states=True`, which would hold all 64 layers of a 27B model at once). The
decoder's own output is already post-final-norm: exactly what lm_head reads.
"""

from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def hooked_layers(layers: nn.ModuleList, layer_ids: list[int]):
    """Yields a dict that fills with {layer id: output [B, T, H]} during a forward."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for k in layer_ids:
        def hook(_module, _args, output, k=k):
            captured[k] = output[0] if isinstance(output, tuple) else output
        handles.append(layers[k].register_forward_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def forward_states(decoder: nn.Module, layer_ids: list[int], input_ids: torch.Tensor,
                   attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Context [B, T, n, H] of the selected layers and final-normed states [B, T, H].

    Batches are right-padded: every real token sits at positions 0..L-1 as in an unpadded
    forward, and causal layers never let padding reach a real token.
    """
    with hooked_layers(decoder.layers, layer_ids) as captured:
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    context = torch.stack([captured[k] for k in layer_ids], dim=2)
    return context, out.last_hidden_state
