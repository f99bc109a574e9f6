"""Point-to-point bandwidth between two ranks: gloo send/recv and a raw TCP socket, each bound to chosen addresses.

Both time one payload from the sender's first byte to the receiver's one-byte acknowledgement, after a small
warm-up exchange (connection set-up and TCP slow start are not part of the figure).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from holmes_lightning.runtime.groups import Transport, new_group
from holmes_lightning.topology import LinkKind

WARMUP_BYTES = 64 * 1024
TIMEOUT = timedelta(seconds=120)


def pair_group(sender: int, receiver: int, link: LinkKind, address: str | None) -> dist.ProcessGroup:
    """A gloo group of the two ranks listening on this rank's `address`; every rank calls it (collective)."""
    return new_group((sender, receiver), "gloo", Transport(link, address), TIMEOUT)


def gloo_seconds(group: dist.ProcessGroup, sender: int, receiver: int, nbytes: int) -> float | None:
    """Seconds to move `nbytes` from sender to receiver over their pair group (None on the receiver)."""
    is_sender = dist.get_rank() == sender
    peer = receiver if is_sender else sender
    ack = torch.zeros(1, dtype=torch.uint8)
    elapsed = None
    for size in (WARMUP_BYTES, nbytes):
        payload = torch.zeros(size, dtype=torch.uint8)
        start = time.perf_counter()
        if is_sender:
            dist.send(payload, peer, group=group)
            dist.recv(ack, peer, group=group)
            elapsed = time.perf_counter() - start
        else:
            dist.recv(payload, peer, group=group)
            dist.send(ack, peer, group=group)
    return elapsed


def socket_seconds(is_sender: bool, own_address: str, peer_address: str, nbytes: int, tag: str) -> float | None:
    """The same over a plain TCP connection: the receiver listens on its address, the sender binds its own."""
    store = dist.PrefixStore(f"holmes-lab/{tag}", dist.distributed_c10d._get_default_store())
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
