"""A TCP relay in front of the test cluster, to stage what PostgreSQL itself
will not do on cue: a cancel it is slow to act on, a close that comes late.

Everything else passes through byte for byte, so scry still talks to a real
PostgreSQL.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

CANCEL = struct.pack("!ii", 16, 80877102)


class PgRelay:
    """``port`` relays to PostgreSQL on ``pg_port``.

    ``hold_cancels``: a CancelRequest is held unanswered (``held`` is set)
    until ``release`` is set, then passed on; if scry closes it first,
    ``given_up`` is set and ``held_for`` says after how long.

    ``close_delay``: when PostgreSQL closes a session, the relay closes its
    side towards scry that much later (what scry does in between is what
    it does with a dying session whose close has not arrived yet).
    """

    def __init__(self, pg_port: int, hold_cancels: bool = False, close_delay: float = 0) -> None:
        self.pg_port = pg_port
        self.hold_cancels = hold_cancels
        self.close_delay = close_delay
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.held = threading.Event()
        self.given_up = threading.Event()
        self.release = threading.Event()
        self.held_for = 0.0
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client = self.srv.accept()[0]
            except OSError:
                return
            self.socks.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        head = client.recv(8, socket.MSG_WAITALL)
        if head == CANCEL and self.hold_cancels:
            self._hold_cancel(client, head + client.recv(8, socket.MSG_WAITALL))
            return
        upstream = socket.create_connection(("127.0.0.1", self.pg_port))
        self.socks.append(upstream)
        upstream.sendall(head)
        to_scry = threading.Thread(
            target=self._pump, args=(upstream, client, self.close_delay), daemon=True
        )
        to_scry.start()
        self._pump(client, upstream, 0)

    def _hold_cancel(self, client: socket.socket, request: bytes) -> None:
        self.held.set()
        started = time.monotonic()
        client.settimeout(0.02)
        while not self.release.is_set():
            try:
                if not client.recv(1024):
                    self.held_for = time.monotonic() - started
                    self.given_up.set()
                    return
            except TimeoutError:
                continue
        with socket.create_connection(("127.0.0.1", self.pg_port)) as upstream:
            upstream.sendall(request)
            upstream.recv(1)  # PostgreSQL closes it once it has acted
        client.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, close_delay: float) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            time.sleep(close_delay)  # (the late close being staged)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.srv.close()
        for s in self.socks:
            s.close()
