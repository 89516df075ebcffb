"""The control channel between two worker processes: small JSON messages over TCP.

    [u32 length, big-endian][UTF-8 JSON object]  ...  one frame per message

Only metadata travels here (KV formats, request ids, page lists, checksums,
transfer uuids, acks); the KV itself goes through `jax.experimental.transfer`.
JSON rather than pickle, so a stray peer cannot run code in this process.
Every wait has a deadline: a silent peer raises TransferTimeout, a closed one
PeerClosed. After either the stream may be cut mid-frame, so the channel
refuses further use and the caller drops it.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import time

from disagg.transfer import TransferError, TransferTimeout

_HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 64 << 20   # a page list of a ~1M-token request is far below this


class PeerClosed(TransferError):
    """The peer closed the connection (or it was dropped after a failure)."""


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port); a clear error names the bad value."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT (e.g. 127.0.0.1:7400)")
    return host.strip("[]"), int(port)


class ControlChannel:
    """One connected peer; `send`/`recv` take a timeout in seconds, always."""

    def __init__(self, sock: socket.socket, peer: str):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self.peer = sock, peer
        self._fd = sock.fileno()
        self._broken = False

    @classmethod
    def connect(cls, address: str, timeout: float, *,
                retry_refused: bool = True) -> "ControlChannel":
        """Connect, retrying a refusal until `timeout` (the peer may still be starting);
        with retry_refused False a refusal fails at once (a peer that was up is gone)."""
        host_port, deadline = parse_address(address), time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection(host_port, timeout=timeout)
                return cls(sock, address)
            except ConnectionRefusedError as e:
                if not retry_refused or time.monotonic() + 0.1 > deadline:
                    raise PeerClosed(f"could not connect to {address} within "
                                     f"{timeout:.1f}s: {e}") from None
                time.sleep(0.1)
            except socket.timeout:
                raise TransferTimeout(f"could not connect to {address} "
                                      f"within {timeout:.1f}s") from None
            except OSError as e:
                raise PeerClosed(f"could not connect to {address}: {e}") from None

    def send(self, message: dict, timeout: float) -> None:
        data = json.dumps(message).encode()
        self._check_usable()
        self._sock.settimeout(timeout)
        with self._failures(f"{self.peer} took no message within {timeout:.1f}s"):
            self._sock.sendall(_HEADER.pack(len(data)) + data)

    def poll(self, timeout: float) -> bool:
        """Whether a message (or EOF) is waiting, after at most `timeout` seconds;
        unlike `recv`, running out of time leaves the channel usable."""
        self._check_usable()
        return bool(select.select([self._sock], [], [], max(timeout, 0.0))[0])

    def recv(self, timeout: float) -> dict:
        self._check_usable()
        deadline = time.monotonic() + timeout
        (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline, timeout))
        if size > MAX_MESSAGE_BYTES:
            self._drop()
            raise TransferError(f"{self.peer} sent a {size}-byte control message "
                                f"(limit {MAX_MESSAGE_BYTES}): not a worker of this project?")
        data = self._read(size, deadline, timeout)
        try:
            message = json.loads(data)
        except ValueError as e:   # bad UTF-8 or JSON
            message, problem = None, f"is not JSON ({e})"
        else:
            problem = f"is a JSON {type(message).__name__}, not an object"
        if not isinstance(message, dict):
            self._drop()   # the stream can't be trusted past a frame we can't read
            raise TransferError(f"{self.peer} sent a control message that {problem}: "
                                f"not a worker of this project?")
        return message

    def _read(self, size: int, deadline: float, timeout: float) -> bytes:
        data = bytearray()
        while len(data) < size:
            left = deadline - time.monotonic()
            with self._failures(f"no message from {self.peer} within {timeout:.1f}s"):
                if left <= 0:
                    raise socket.timeout
                self._sock.settimeout(left)
                chunk = self._sock.recv(size - len(data))
            if not chunk:
                self._drop()
                raise PeerClosed(f"{self.peer} closed the connection")
            data += chunk
        return bytes(data)

    @contextlib.contextmanager
    def _failures(self, timed_out: str):
        """Socket timeouts and errors become TransferTimeout / PeerClosed, and
        the channel is dropped (a half-sent or half-read frame can't be resumed)."""
        try:
            yield
        except socket.timeout:
            self._drop()
            raise TransferTimeout(timed_out) from None
        except OSError as e:
            self._drop()
            raise PeerClosed(f"{self.peer} closed the connection: {e}") from None

    def _drop(self) -> None:
        # Closing at once tells the peer (EOF) instead of leaving it to time out.
        self._broken = True
        self._sock.close()

    def fileno(self) -> int:
        """The socket's descriptor (for select over several channels)."""
        return self._fd

    @property
    def broken(self) -> bool:
        return self._broken

    def _check_usable(self) -> None:
        if self._broken:
            raise PeerClosed(f"the channel to {self.peer} was dropped after an earlier failure")

    def close(self) -> None:
        self._drop()


class Listener:
    """A listening TCP socket; `accept` waits at most `timeout` seconds."""

    def __init__(self, address: str):
        host, port = parse_address(address)
        self._sock = socket.create_server((host, port))
        self.address = f"{host}:{self._sock.getsockname()[1]}"

    def accept(self, timeout: float | None) -> ControlChannel:
        self._sock.settimeout(timeout)
        try:
            sock, (host, port, *_) = self._sock.accept()
        except socket.timeout:
            raise TransferTimeout(f"no peer connected to {self.address} "
                                  f"within {timeout:.1f}s") from None
        return ControlChannel(sock, f"{host}:{port}")

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()
