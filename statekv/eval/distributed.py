"""Data-parallel evaluation: which rank this process is, its device, and the wait before the merge.

``torchrun`` and ``accelerate launch`` both start one process per device and set ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK``; a plain ``python`` run is rank 0 of 1. Each rank evaluates its
own videos (`statekv.eval.sharding`) and appends to its own records file, so ranks never talk
during the run. They meet once, at the end, so that rank 0 merges only after every rank has
finished.

That barrier runs over a gloo process group (joined when the run starts, so a broken launch fails
early), even on GPUs: NCCL's watchdog aborts a collective that waits longer than its timeout, and
the fastest rank may wait hours for the slowest. If a rank dies, the launcher stops the others; a rank that was
waiting for it meanwhile stops with one line (`statekv.errors.RankLostError`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from dataclasses import dataclass, field

from statekv.errors import ConfigurationError, RankLostError

BARRIER_TIMEOUT = datetime.timedelta(days=7)


@dataclass
class RankContext:
    """This process's place in a data-parallel run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    _owns_group: bool = field(default=False, repr=False, compare=False)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RankContext:
        """From ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (as set by torchrun and accelerate launch)."""
        environ = os.environ if environ is None else environ
        try:
            rank = int(environ.get("RANK", 0))
            world_size = int(environ.get("WORLD_SIZE", 1))
            local_rank = int(environ.get("LOCAL_RANK", rank))
        except ValueError as error:
            raise ConfigurationError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers ({error})") from None
        if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
            raise ConfigurationError(f"inconsistent launcher environment: RANK={rank}, WORLD_SIZE={world_size}, "
                                     f"LOCAL_RANK={local_rank}")
        return cls(rank, world_size, local_rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def default_device(self) -> str:
        """``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``."""
        import torch

        return f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"

    def connect(self) -> None:
        """Join the launcher's process group (a no-op for a single process). Called at the start of a run,
        so a broken launch fails at once rather than after hours of work."""
        if not self.distributed:
            return
        import torch.distributed as dist

        if not dist.is_available():
            raise ConfigurationError("a multi-process run needs torch.distributed, which this torch build lacks")
        if not dist.is_initialized():  # MASTER_ADDR/MASTER_PORT come from the launcher
            try:
                dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size, timeout=BARRIER_TIMEOUT)
            except (ValueError, RuntimeError) as error:  # torch's: a variable unset or unusable, no rendezvous
                raise ConfigurationError(f"rank {self.rank} of {self.world_size} cannot join the launch's process "
                                         f"group ({_cause(error)}); start the ranks with torchrun or accelerate "
                                         "launch, which set MASTER_ADDR and MASTER_PORT") from None
            self._owns_group = True

    def barrier(self) -> None:
        """Wait until every rank has called this (a no-op for a single process)."""
        if not self.distributed:
            return
        import torch.distributed as dist

        self.connect()
        # a group someone else initialised (e.g. NCCL) gets a gloo side group for this one wait
        with self._waiting():
            dist.barrier(group=self._gloo_group())

    def share_from_main(self, value):
        """Rank 0's ``value`` on every rank (``value`` itself in a single process); a small picklable object."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        self.connect()
        objects = [value if self.is_main else None]
        with self._waiting():
            dist.broadcast_object_list(objects, src=0, group=self._gloo_group())
        return objects[0]

    @contextlib.contextmanager
    def _waiting(self):
        """A wait for the other ranks; a rank gone meanwhile (gloo: its connection closed) is one line, not gloo's
        traceback."""
        try:
            yield
        except RuntimeError as error:  # torch.distributed's errors (DistError and its kinds) are RuntimeErrors
            raise RankLostError(f"rank {self.rank} of {self.world_size}: another rank of this run stopped while this "
                                f"one waited for it (see its own lines; {_cause(error)}); the answers written are "
                                "kept: rerun the same command to resume") from None

    def _gloo_group(self):
        """None (the default group) when it runs gloo, else a gloo side group (waits without NCCL's watchdog)."""
        import torch.distributed as dist

        return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=BARRIER_TIMEOUT)

    def close(self) -> None:
        """Tear down the process group if `barrier` created it."""
        if self._owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._owns_group = False


def _cause(error: BaseException) -> str:
    """The first sentence of a torch.distributed error, without the source location gloo puts first."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0] if str(error).strip() else "")
    return re.split(r"(?<=[a-z0-9])\. ", text, maxsplit=1)[0].rstrip(".")[:160] or type(error).__name__
