"""Point-to-point bandwidth between two ranks: gloo send/recv and a raw TCP socket, each bound to chosen addresses.

Both time one payload from the sender's first byte to the receiver's one-byte acknowledgement, after a small
warm-up exchange (connection set-up and TCP slow start are not part of the figure).
"""

from __future__ import annotations

import socket
import time

import torch
from torch.distributed import ProcessGroupGloo

from holmes_lightning.lab.groups import address_bound_group, lab_store

WARMUP_BYTES = 64 * 1024


def gloo_seconds(sender: int, receiver: int, address: str | None, nbytes: int, tag: str) -> float | None:
    """Seconds to move `nbytes` from sender to receiver over a gloo pair bound to each side's `address`."""
    group = address_bound_group([sender, receiver], address, tag)
    assert group is not None, "gloo_seconds is called on the two ranks of the pair only"
    is_sender = group.rank() == sorted([sender, receiver]).index(sender)
    peer = 1 - group.rank()
    ack = torch.zeros(1, dtype=torch.uint8)
    elapsed = None
    for step, size in enumerate((WARMUP_BYTES, nbytes)):
        payload = torch.zeros(size, dtype=torch.uint8)
        start = time.perf_counter()
        if is_sender:
            _send(group, payload, peer, 2 * step)
            _recv(group, ack, peer, 2 * step + 1)
            elapsed = time.perf_counter() - start
        else:
            _recv(group, payload, peer, 2 * step)
            _send(group, ack, peer, 2 * step + 1)
    return elapsed if is_sender else None


def _send(group: ProcessGroupGloo, tensor: torch.Tensor, peer: int, tag: int) -> None:
    group.send([tensor], peer, tag).wait()


def _recv(group: ProcessGroupGloo, tensor: torch.Tensor, peer: int, tag: int) -> None:
    group.recv([tensor], peer, tag).wait()


def socket_seconds(is_sender: bool, own_address: str, peer_address: str, nbytes: int, tag: str) -> float | None:
    """The same over a plain TCP connection: the receiver listens on its address, the sender binds its own."""
    store = lab_store(tag)
    if not is_sender:
        with socket.create_server((own_address, 0)) as server:
            store.set("port", str(server.getsockname()[1]))
            connection, _ = server.accept()
        with connection:
            for size in (WARMUP_BYTES, nbytes):
                _receive_exactly(connection, size)
                connection.sendall(b"k")
        return None
    port = int(store.get("port"))
    with socket.create_connection((peer_address, port), source_address=(own_address, 0)) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        elapsed = 0.0
        for size in (WARMUP_BYTES, nbytes):
            payload = bytes(size)
            start = time.perf_counter()
            connection.sendall(payload)
            _receive_exactly(connection, 1)
            elapsed = time.perf_counter() - start
        return elapsed


def _receive_exactly(connection: socket.socket, size: int) -> None:
    buffer = bytearray(min(size, 1 << 20))
    left = size
    while left:
        got = connection.recv_into(buffer, min(left, len(buffer)))
        if not got:
            raise ConnectionError(f"peer closed the probe connection with {left} of {size} bytes still to come")
        left -= got
