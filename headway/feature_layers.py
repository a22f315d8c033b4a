"""Which target hidden states a drafter kind reads by default: pure functions of the target's depth,
shared by the heads that read them and by ``headway features``, which stores them beforehand.

Layers are HF ``output_hidden_states`` indices: 0 = the embeddings, i = the output of decoder layer
i-1 (the input of layer i), L = the last layer's output after the final norm.
"""

from __future__ import annotations

def eagle3_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high layers: (2, L//2, L-3) when those are distinct; shallower
    targets get three distinct indices spread as evenly as they allow."""
    L = num_hidden_layers
    if L < 2:
        raise ValueError(f"EAGLE-3 needs a target with at least 2 layers; this one has {L}")
    for want in ([2, L // 2, L - 3], [1, L // 2, L - 1], [L - 2, L - 1, L]):
        if 0 <= want[0] < want[1] < want[2] <= L:
            return want
    raise AssertionError("unreachable")  # [L-2, L-1, L] always qualifies


DFLASH_CONTEXT_LAYERS = 5  # target layers a DFlash context fuses by default (the published drafters use 5-6)


def dflash_layers(num_hidden_layers: int, n: int = DFLASH_CONTEXT_LAYERS) -> list[int]:
    """``n`` indices spread from the 2nd layer's output to the (L-2)th, as the DFlash reference picks
    them (its decoder layers 1 .. L-3, rounded); fewer, evenly thinned, on targets too shallow for n."""
    L = num_hidden_layers
    if L < 1:
        raise ValueError(f"DFlash needs a target with at least 1 layer; this one has {L}")
    if n == 1:
        return [L // 2 + 1]
    span = L - 4
    picks = [int(round(1 + i * span / (n - 1))) + 1 for i in range(n)] if span > 0 else []
    if len(set(picks)) == n:
        return picks
    n = min(n, L)
    return sorted({1 + round(i * (L - 1) / max(1, n - 1)) for i in range(n)})
