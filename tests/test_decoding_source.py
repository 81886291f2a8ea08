"""Answers are decoded from the detailed cache (every streamed token), never from the small carried state.

Under full attention, or a budget as large as the stream, the carried state *is* the detailed cache, so only a
small budget tells the two apart: there the engine's answer must be exactly what transformers' own
``generate`` produces over a plain ``DynamicCache`` holding the detailed cache.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

import statekv
from conftest import CHUNK_LENGTHS, split

TOTAL = sum(CHUNK_LENGTHS)
NEW_TOKENS = 8


def _cache_of(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys.clone(), values.clone(), index)
    return cache


@torch.no_grad()
def test_answers_come_from_the_detailed_cache_not_the_carried_state(tiny_lm):
    model = tiny_lm("qwen3")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, TOTAL), generator=generator)
    prompt = torch.randint(0, model.config.vocab_size, (1, 6), generator=generator)
    prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=8), attention="eager", horizon=TOTAL + 32)
    for chunk in split(ids):
        prefill.step(input_ids=chunk)
    assert max(prefill.stats.carried_tokens) == 8 < TOTAL  # the carried state is a small part of the stream

    detailed = [(layer.keys, layer.values) for layer in prefill.detailed_cache.layers]
    assert all(keys.shape[2] == TOTAL for keys, _ in detailed)
    answer = prefill.generate(prompt, max_new_tokens=NEW_TOKENS)
    reference = model.generate(torch.cat([ids, prompt], dim=1), past_key_values=_cache_of(detailed),
                               attention_mask=torch.ones(1, TOTAL + prompt.shape[1], dtype=torch.long),
                               max_new_tokens=NEW_TOKENS, do_sample=False)[:, TOTAL + prompt.shape[1]:]
    assert torch.equal(answer, reference)

    # The premise: the carried state alone is another context, which gives another first answer token's logits
    # (so decoding from it instead would fail the comparison above).
    positions = torch.arange(TOTAL, TOTAL + prompt.shape[1])[None]
    from_detailed = model(prompt, past_key_values=_cache_of(detailed), position_ids=positions).logits[0, -1]
    carried = [prefill.carried(layer) for layer in range(model.config.num_hidden_layers)]
    from_carried = model(prompt, past_key_values=_cache_of(carried), position_ids=positions).logits[0, -1]
    assert int(from_detailed.argmax()) == int(answer[0, 0])
    assert (from_carried - from_detailed).abs().max() > 0.1
