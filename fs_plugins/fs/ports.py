"""Free TCP ports for the parties of a federation on one machine (`fs-plugins launch`, the
plugin's comm manager outside an FS worker, tests)."""
from __future__ import annotations

import socket


def free_ports(count: int, host: str = '127.0.0.1') -> list[int]:
    """`count` distinct ports on `host` that were free a moment ago (bound together, then
    released)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
