"""Local TCP ports: the one way the package picks a port for a process it starts (a serving
engine for `eval --served`, the rendezvous of quickstart's ranks)."""

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, as the OS picks it. The caller's
    process binds it moments later; another process could take it in between, which a
    failed start then names."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
