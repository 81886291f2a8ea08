"""Whether a served disk-tier stream is to be brought back from its folder (`statekv.serve.healing.StreamHealer`),
and why: a handover stopped once marked closed it, or a force of its files to the device failed (it is never
checkpointed again); and what a push refused by a failed force tells its client. Read from what the stream holds
alone, so the feeds of files (`statekv.serve.feeding`) ask it too."""

from __future__ import annotations

from typing import Any

from ..core.disk.successor import HANDOVER_MARKER


# what a push refused by a failed force tells the client: the retry brings the stream back (`StreamHealer.heal`);
# a feed's says how a feed goes on instead (`statekv.serve.feeding.unforced_feed`)
UNFORCED = ("this frame was not streamed, and the stream is never checkpointed again: its next request brings it back "
            "from its offload folder at its last checkpoint forced to the device, the frames pushed after it lost")
BROUGHT_BACK = f"{UNFORCED}; push this frame again, and if that push answers 409, push again from the frame it names " \
               "(resume_from)"


def to_bring_back(entry: Any) -> bool:
    """Whether a served disk-tier stream is to be brought back from its folder (`StreamHealer.heal`): a stopped
    handover closed it, or a force of its files failed."""
    return closed_by_handover(entry) or unforced(entry) is not None


def closed_when(entry: Any) -> str:
    """Why the stream is brought back, in messages (`to_bring_back`)."""
    return "when its handover stopped" if unforced(entry) is None else \
        "when its files could not be forced to the device"


def unforced(entry: Any) -> str | None:
    """Why a force of a served disk-tier stream's files to the device failed (`DiskTier.force_failed`: it is never
    checkpointed again, `statekv.core.disk.forcing`), or of its handover successor's (every replay it checkpoints is
    refused from then on, so the stream would pass the model's range without it: resumed, it rebuilds it from its
    backlog); None when none failed, or it is deleted or moved."""
    why = own_unforced(entry)
    if why is not None or entry.deleted or entry.moved:
        return why
    failed = getattr(getattr(getattr(entry.stream, "successor", None), "disk", None), "force_failed", None)
    return None if failed is None else f"its successor's: {failed}"


def own_unforced(entry: Any) -> str | None:
    """`unforced`, of the stream's own files alone (its successor's may fail and the stream still be saved)."""
    tier = getattr(getattr(entry.stream, "durability", None), "tier", None)
    return None if tier is None or entry.deleted or entry.moved else tier.force_failed


def closed_by_handover(entry: Any) -> bool:
    """Whether a served disk-tier stream was closed by a handover stopped once marked (its folder holds the
    marker: resuming it finishes the handover); not one closed otherwise (its folder moved away, say)."""
    tier = entry.tier
    return getattr(getattr(entry.stream, "prefill", None), "closed", False) and tier is not None and \
        not (entry.deleted or entry.moved) and (tier / HANDOVER_MARKER).is_file()
