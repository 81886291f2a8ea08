"""The settings of one `statekv serve` process."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..settings.options import ModelOptions
from .errors import public_message

SAVE_EVERY_FRAMES = 256
SAVE_EVERY_SECONDS = 30.0


@dataclass
class ServeConfig:
    """options: the model and the default method settings (streams may choose their own method settings).
    state_dir: where streams are kept (created); None only for replicas on Ray that keep everything in an object
    store (`statekv.serve.cluster.deployment.ClusterSettings.store`). media_root: the only folder server-side
    sources may be read from (None: no server-side sources). api_keys: the keys accepted besides the key made for
    the state folder (`auth.KeyFile`); at least one of the two. drop_unowned_streams: delete, at start, the streams
    of keys not accepted (otherwise the server refuses to start over them). max_streams: streams held
    at once, all keys together. max_asks: questions answered or waiting at once. max_followers: clients following
    watch events at once (``GET /v1/streams/{id}/events``), all keys together. max_body_bytes: the largest
    request body; max_image_pixels: the largest decoded frame. save_every_frames / save_every_seconds: a
    stream with unsaved frames is saved after this many frames or seconds, whichever comes first.
    default_horizon_frames, default_max_fps: for streams created without them (horizon None: no horizon, the
    stream never ends; its positions are bounded, see `statekv.core.positions.placing`). quiet_catch_up:
    replay the handover backlogs of streams past half the model's range when no push or question waits
    (`statekv.serve.worker`), rather than all at once in the push that passes the range.
    """

    options: ModelOptions
    state_dir: Path | None
    api_keys: tuple[str, ...] = ()
    drop_unowned_streams: bool = False
    media_root: Path | None = None
    max_streams: int = 64
    max_asks: int = 32
    max_followers: int = 256
    max_body_bytes: int = 16 * 2**20
    max_image_pixels: int = 4096 * 4096
    save_every_frames: int = SAVE_EVERY_FRAMES
    save_every_seconds: float = SAVE_EVERY_SECONDS
    default_horizon_frames: int | None = None
    default_max_fps: float | None = 1.0
    max_chat_frames: int = 512
    page: bool = True
    quiet_catch_up: bool = True
    extra: dict = field(default_factory=dict)

    def public(self, message: str) -> str:
        """A message as a client may see it: paths under the state folder, the media root or the disk tier's
        folder made relative to it (their absolute forms: a relative one says nothing of the server's layout)."""
        folders = [folder for folder in (self.state_dir, self.media_root, self.options.offload_dir)
                   if folder is not None]
        replacements = {}
        for folder in folders:
            for form in (os.path.abspath(folder), os.path.realpath(folder)):
                replacements[form.rstrip("/") + "/"] = ""
        return public_message(message, replacements)
