"""An independent reference of streaming prefill, built only from transformers' own pieces.

Each chunk is one forward of the model with ``attn_implementation="eager"``: its carried K/V are handed in
as a plain ``DynamicCache``, visibility as an explicit 4-D additive mask (carried keys visible, the chunk
causal), positions as logical ``position_ids``; the attention probabilities come from
``output_attentions``. The carried state is then chosen by brute force from those probabilities. Nothing of
statekv's cache, attention or policies is used, so agreement checks all three.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def top_budget(scores, positions, budget, **_):
    """Brute-force StateKV rule: indices of the ``budget`` largest scores per row, in time order."""
    if scores.shape[-1] <= budget:
        return None
    return scores.topk(budget, dim=-1).indices.sort(dim=-1).values


def last_steps(scores, positions, steps, step, frames, **_):
    keep = steps[0, 0] > step - frames
    return keep.nonzero().squeeze(-1).expand(*scores.shape[:2], -1)


@torch.no_grad()
def reference_stream(model, chunks, rule, **rule_args):
    """Yield ``(last_hidden [1, T, D], carried)`` after each chunk; ``carried[layer] = (k, v, positions)``."""
    decoder = model.get_decoder()
    config = decoder.config
    previous = config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        layers = config.num_hidden_layers
        carried = [None] * layers
        steps_of = [torch.empty(1, config.num_key_value_heads, 0, dtype=torch.long) for _ in range(layers)]
        seen = 0
        for step, chunk in enumerate(chunks):
            t = chunk.shape[1]
            cache = DynamicCache()
            for index, state in enumerate(carried):
                if state is not None:
                    cache.update(state[0], state[1], index)
            k_carried = 0 if carried[0] is None else carried[0][0].shape[2]
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(1, 1, t, k_carried + t, dtype=dtype)
            causal = torch.ones(t, t, dtype=torch.bool).triu(1)
            mask[..., k_carried:] = mask[..., k_carried:].masked_fill(causal, torch.finfo(dtype).min)
            out = decoder(input_ids=chunk, position_ids=torch.arange(seen, seen + t)[None], attention_mask=mask,
                          past_key_values=cache, use_cache=True, output_attentions=True)
            for index in range(layers):
                probs = out.attentions[index].float()  # [1, Hq, T, K + T]
                hkv = config.num_key_value_heads
                scores = probs.sum(dim=2).reshape(1, hkv, -1, k_carried + t).sum(dim=2)
                keys, values = cache.layers[index].keys, cache.layers[index].values
                chunk_positions = torch.arange(seen, seen + t).expand(1, hkv, -1)
                positions = chunk_positions if carried[index] is None else torch.cat(
                    [carried[index][2], chunk_positions], dim=-1)
                steps = torch.cat([steps_of[index], torch.full((1, hkv, t), step)], dim=-1)
                keep = rule(scores=scores, positions=positions, steps=steps, step=step, keys=keys, **rule_args)
                if keep is not None:
                    keys = keys.gather(2, keep[..., None].expand(-1, -1, -1, keys.shape[-1]))
                    values = values.gather(2, keep[..., None].expand(-1, -1, -1, values.shape[-1]))
                    positions, steps = positions.gather(2, keep), steps.gather(2, keep)
                carried[index] = (keys, values, positions)
                steps_of[index] = steps
            seen += t
            yield out.last_hidden_state, carried
    finally:
        model.set_attn_implementation(previous)
