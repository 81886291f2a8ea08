"""Ray Serve autoscaling on streams: `StreamsPolicy` (a custom policy, given to Ray Serve by import path) asks for
as many replicas as the streams held need at ``target`` streams each. Each replica reports the streams it holds
(``record_autoscaling_stats``: ``{"streams": N}``); Ray Serve averages them over ``look_back_period_s``, and applies
``min_replicas``/``max_replicas``, the up- and downscale delays and factors around this policy.

Ray Serve pickles this module by value for its controller, so it imports nothing of statekv.
"""

from __future__ import annotations

import math
from typing import Any

STREAMS_METRIC = "streams"


class StreamsPolicy:
    """Replicas for the streams held: ``ceil(streams / target)`` (Ray Serve keeps it within ``min_replicas`` and
    ``max_replicas``). A replica scaled down saves its streams and lets them go; each comes back, whole, on the
    replica its next request is routed to."""

    def __init__(self, target: float):
        if not target > 0:
            raise ValueError(f"the streams-per-replica target must be positive, got {target!r}")
        self.target = float(target)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        held = (ctx.aggregated_metrics or {}).get(STREAMS_METRIC, {})
        streams = sum(held.values())
        return math.ceil(streams / self.target), {"streams": streams}
