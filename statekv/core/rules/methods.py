"""The built-in methods: each carry rule under the name users type (``--method statekv``), with how it is described
and sized (`statekv.settings.methods.MethodSpec`). A rule of your own is registered the same way, from anywhere.
"""

from __future__ import annotations

from ...settings.methods import (MethodSpec, at_most_budget, every_earlier_token, last_window, register_method,
                                 sinks_and_last_window, within_recent_window)
from .attention_mass import StateKV
from .full import FullAttention
from .key_norm import KeyNorm
from .recency import Recency
from .rekv import ReKV

register_method(MethodSpec(
    "statekv", "carry the top-B tokens by attention mass, per layer and KV head", "budget",
    lambda s, f: StateKV(budget=s.budget), at_most_budget, "StateKV"))
register_method(MethodSpec(
    "full", "carry everything: exact, quadratic in length", None,
    lambda s, f: FullAttention(), every_earlier_token, "Full SA"))
register_method(MethodSpec(
    "recency", "carry the last R frames (a sliding window: the paper's ReKV baseline)", "frames",
    lambda s, f: Recency(frames=s.window_steps(f)), last_window, "Recency"))
register_method(MethodSpec(
    "rekv", "ReKV: sinks + the last R frames while encoding; questions answered from the 64 frames per layer that "
            "best match them, the detailed cache kept in CPU memory", "frames",
    lambda s, f: ReKV(frames=s.window_steps(f), sinks=s.sinks), sinks_and_last_window, "ReKV",
    retrieve=64, offload=True, also_uses=("sinks",), retrieval="rekv"))
register_method(MethodSpec(
    "keynorm", "carry the B tokens with the smallest key norm, per layer and KV head", "budget",
    lambda s, f: KeyNorm(budget=s.budget), at_most_budget, "KeyNorm"))
register_method(MethodSpec(
    "simplestream", "SimpleStream: no cache; each question is answered by the unmodified model from the last N frames "
                    "and the prompt alone, encoded afresh", "window",
    lambda s, f: FullAttention(), within_recent_window, "SimpleStream", recent_window=True))
