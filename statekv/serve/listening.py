"""The sockets a server alone listens on, bound before it touches its state folder or loads its model and then
handed to uvicorn (so nothing can take the port in between): a port in use, or a host this machine cannot listen
on, is one line at once."""

from __future__ import annotations

import errno
import os
import socket

from ..errors import ConfigurationError


def shown_address(host: str, port: int) -> str:
    """``host:port`` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to ``host``:``port`` (port 0: a free one), one per address ``host`` names, as asyncio's own
    server binds them (not yet listening: uvicorn starts that); a one-line `ConfigurationError` naming host,
    port and the reason when one cannot be bound."""
    where = shown_address(host, port)
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigurationError(f"cannot listen on {where}: {reason}; give --host an address of this machine "
                                 "(default: 127.0.0.1)") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, protocol, _, address in dict.fromkeys(found):
            bound = socket.socket(family, kind, protocol)
            sockets.append(bound)
            if os.name == "posix":  # a restart binds at once, past the old connections' TIME_WAIT
                bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                bound.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            bound.bind(address)
    except OSError as error:
        for bound in sockets:
            bound.close()
        advice = ("another process listens there: stop it, or give another --port (0 picks a free one)"
                  if error.errno == errno.EADDRINUSE else "give --host an address of this machine, or another --port")
        raise ConfigurationError(f"cannot listen on {where}: {error.strerror or error}; {advice}") from None
    return sockets
