"""Server-side sources: files under ``--media-root`` only (no ``..``, no symlink that leads out)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from .errors import ServiceError
from .stream_settings import shown

MAX_SOURCE_CHARS = 4096  # Linux's PATH_MAX: no longer path names a file


def resolve_source(media_root: Path | None, source: object) -> Path:
    """``source`` (a path relative to the media root, absolute inside it, or a ``file://`` URL of one) as a real file
    inside the root."""
    if media_root is None:
        raise ServiceError(403, "server-side sources are off: start the server with --media-root DIR")
    if not isinstance(source, str) or not source.strip() or "\x00" in source:
        raise ServiceError(400, "source must be a non-empty path (a file under the server's --media-root)")
    if source[:5].lower() == "file:":  # file:///srv/x.mp4, or file:/srv/x.mp4
        return resolve_source(media_root, _file_path(source, "source"))
    if len(source) > MAX_SOURCE_CHARS:
        raise ServiceError(400, f"source is {len(source)} characters long, over the limit of {MAX_SOURCE_CHARS}")
    shown = repr(source if len(source) <= 80 else source[:77] + "...")
    root = Path(os.path.realpath(media_root))
    given = Path(source)
    if ".." in given.parts:
        raise ServiceError(403, f"source {shown} leaves the media root ('..' is not allowed)")
    candidate = given if given.is_absolute() else root / given
    try:
        real = Path(os.path.realpath(candidate))
        if real != root and root not in real.parents:
            raise ServiceError(403, f"source {shown} is outside the media root")
        if real.is_dir():
            raise ServiceError(400, f"source {shown} is a folder: name a video file in it")
        if not real.exists():
            raise ServiceError(404, f"source {shown}: no such file under the media root")
        if not real.is_file():
            raise ServiceError(400, f"source {shown} is not a regular file (a named pipe, device or socket): name a "
                                    "video file")
    except OSError as error:  # a name too long for the filesystem, a component that is not a folder...
        raise ServiceError(400, f"source {shown}: cannot be opened ({error.strerror or type(error).__name__})") from None
    return real


def resolve_file_url(media_root: Path | None, url: object) -> Path:
    """A ``file://`` URL of a file under the media root (as vLLM's --allowed-local-media-path)."""
    if not isinstance(url, str):
        raise ServiceError(400, "video_url.url must be a string")
    return resolve_source(media_root, _file_path(url, "video_url.url"))


def _file_path(url: str, name: str) -> str:
    """The local path a ``file://`` URL names (``name``: the field it was given in, for the error)."""
    try:
        parsed = urlparse(url)
    except ValueError:  # a bracket without its pair, a host NFKC makes into another
        raise ServiceError(400, f"{name} {shown(url)} is not a URL") from None
    if parsed.scheme != "file":
        raise ServiceError(400, "only file:// video URLs under the server's --media-root are read, got "
                                f"{shown(parsed.scheme) if parsed.scheme else 'no'} scheme")
    if parsed.netloc not in ("", "localhost"):
        raise ServiceError(400, f"file URL with a host ({shown(parsed.netloc)}) is not a local file")
    return unquote(parsed.path)
