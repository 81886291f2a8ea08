"""Carry rules: which tokens a layer keeps in its carried state after each step, one rule per module.

A policy sees the candidates of one layer after one step (the tokens it carried into the step, then the
step's own tokens) and returns which of them to carry into the next step. Everything else about streaming
(the detailed cache, positions, attention) is shared, so a new rule is one small class. Most rules score
tokens and keep the best ones; they subclass :class:`ScoredPolicy` and return one score per candidate:

    @dataclass(frozen=True)
    class ValueNorm(ScoredPolicy):
        def score(self, c):
            return c.values.float().norm(dim=-1)      # [B, H_kv, N]: carry the largest values

The base keeps the ``budget`` best per (batch, KV head), in time order, and its steady steps can be captured
as a CUDA graph. Any other rule overrides :meth:`CarryPolicy.select`, returning a ``slice`` over the
candidate axis (the same for every head) or a LongTensor ``[B, H_kv, K]`` of candidate indices sorted
ascending (see :class:`SinksAndRecency`).

Rules compose by wrapping (`WrappedPolicy`), as kvpress's presses do: :class:`WithSinks` always carries a
protected prefix (the prompt prefix and attention sinks) and lets another rule choose among the rest;
:class:`PerLayerBudget` gives a scored rule its own budget in each layer; :class:`ReKV` is sinks around recency,
``WithSinks(Recency(frames), sinks)``. A rule may read the step's queries (``candidates.queries``), for example to
score keys by the attention of the step's last queries alone.

The modules: `candidates` (what a rule sees), `base` (`CarryPolicy`), `scored` (`ScoredPolicy`: top-k once),
`wrapped` (`WrappedPolicy`), one module per rule (`full`, `recency`, `attention_mass`: StateKV, `key_norm`,
`sinks`: WithSinks, `rekv`, `per_layer`, `sinks_and_recency`). The built-in methods that name them for users are
described in `statekv.settings.methods` (`BUILTIN_METHODS`).
"""

from .attention_mass import StateKV
from .base import KEEP_ALL, CarryPolicy
from .candidates import Candidates
from .full import FullAttention
from .key_norm import KeyNorm
from .per_layer import PerLayerBudget
from .recency import Recency
from .rekv import ReKV
from .scored import ScoredPolicy, in_time_order
from .sinks import WithSinks
from .sinks_and_recency import SinksAndRecency
from .wrapped import WrappedPolicy

__all__ = ["KEEP_ALL", "Candidates", "CarryPolicy", "FullAttention", "KeyNorm", "PerLayerBudget", "ReKV", "Recency",
           "ScoredPolicy", "SinksAndRecency", "StateKV", "WithSinks", "WrappedPolicy", "in_time_order"]
