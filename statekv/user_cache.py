"""Where statekv keeps what it builds once per user: ``$STATEKV_CACHE``, else ``$XDG_CACHE_HOME/statekv``, else
``~/.cache/statekv`` (the demo's model and video, the Triton kernel's chosen tiles, this installation's secret);
without a home folder, one in the temporary folder.

The secret (`installation_secret`) keys the owner digests recorded in saved streams and disk-tier file sets: a file
moved to another installation (or kept after the secret was removed) no longer proves its owner there, and is
refused for an owner until it is re-owned (``statekv reown``). Removing the cache folder removes it too;
``$STATEKV_SECRET_FILE`` keeps it elsewhere."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .flushing import flush_folder


def variable_path(name: str) -> Path | None:
    """The absolute path the environment variable ``name`` gives (``~`` expanded); None when it is unset or empty.
    A one-line `ConfigurationError` naming it when it is relative (it would move with the working folder, and this
    installation's secret with it) or its ``~`` names no home folder."""
    from .errors import ConfigurationError

    text = os.environ.get(name, "")
    if not text.strip():
        return None
    try:
        path = Path(text).expanduser()
    except RuntimeError:  # ~ without a home folder, or ~user of no such user
        raise ConfigurationError(f"{name}={text!r}: its ~ names no home folder here; give an absolute path") from None
    if not path.is_absolute():
        raise ConfigurationError(f"{name}={text!r} is a relative path, which would change with the working folder; "
                                 "give an absolute path")
    return path


def cache_dir() -> Path:
    """The cache folder (not created here); a one-line `ConfigurationError` when ``STATEKV_CACHE`` is malformed
    (`variable_path`)."""
    given = variable_path("STATEKV_CACHE")
    if given is not None:
        return given
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative one is ignored
        return Path(xdg) / "statekv"
    try:
        home = Path.home()
    except (RuntimeError, KeyError, OSError):  # no HOME and no password entry (containers, daemons)
        home = None
    if home is None or not str(home).strip() or str(home) == ".":
        return Path(tempfile.gettempdir()) / f"statekv-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    return home / ".cache" / "statekv"


# -- the installation's secret ----------------------------------------------------------------------------------
SECRET_FILE = "installation.secret"  # in `cache_dir()`: 64 hex digits, readable by its user alone
SECRET_HEX = 64


def secret_path() -> Path:
    """Where this installation's secret lives: ``$STATEKV_SECRET_FILE``, else ``installation.secret`` in
    `cache_dir()`. (Processes on several machines that share streams' files, as a ``--ray`` deployment's replicas
    do, need one secret: point ``STATEKV_SECRET_FILE`` at one file they all read.)"""
    return variable_path("STATEKV_SECRET_FILE") or cache_dir() / SECRET_FILE


def installation_secret(*, create: bool) -> bytes | None:
    """This installation's secret (`secret_path`), which keys the owner digests statekv records in the files a
    stream writes, so no file can be made to name an owner without it. ``create``: made (32 random bytes) on first
    use; else None when there is none. A one-line `OutputError` when it cannot be made, a `ConfigurationError` when
    the file there is not one."""
    from .errors import ConfigurationError, OutputError

    path = secret_path()
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        if not create:
            return None
        return _make_secret(path, OutputError)
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigurationError(f"cannot read statekv's installation secret {path}: "
                                 f"{getattr(error, 'strerror', None) or error}") from None
    if len(text) != SECRET_HEX or any(c not in "0123456789abcdef" for c in text):
        raise ConfigurationError(f"{path} is not a statekv installation secret ({SECRET_HEX} hex digits); remove it "
                                 "to make a new one (streams owned under the old one must then be re-owned: "
                                 "statekv reown --help)")
    return bytes.fromhex(text)


def _make_secret(path: Path, error: type) -> bytes:
    secret = os.urandom(SECRET_HEX // 2)
    partial = path.with_name(f"{path.name}.{os.getpid()}.{secret[:4].hex()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, f"{secret.hex()}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(partial, path)  # never over a secret another process made meanwhile
        except FileExistsError:
            return installation_secret(create=False)
        flush_folder(path.parent)  # its name too: a power loss cannot take back a secret streams are owned under
    except OSError as failure:
        raise error(f"cannot make statekv's installation secret {path}: {failure.strerror or failure}; set "
                    "STATEKV_CACHE to a folder this user can write") from None
    finally:
        try:
            partial.unlink()
        except OSError:
            pass
    return secret
