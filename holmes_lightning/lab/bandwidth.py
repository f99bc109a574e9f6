"""Point-to-point bandwidth between two ranks: gloo send/recv and a raw TCP socket, each bound to chosen addresses.

The sender streams a head (a quarter of the bytes) and the tail back to back; the receiver times the tail, from the
head's last byte to the tail's. That is the steady-state rate: TCP slow start, latency and the shaper's initial burst
all fall into the untimed head. What is left is one frame (9 KB) at the boundary: under 2% at the default sizes.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from holmes_lightning.runtime.groups import Transport, new_group
from holmes_lightning.topology import LinkKind

TIMEOUT = timedelta(seconds=120)


def pair_group(sender: int, receiver: int, link: LinkKind, address: str | None) -> dist.ProcessGroup:
    """A gloo group of the two ranks listening on this rank's `address`; every rank calls it (collective)."""
    return new_group((sender, receiver), "gloo", Transport(link, address), TIMEOUT)


def _split(nbytes: int) -> tuple[int, int]:
    return nbytes // 4, nbytes - nbytes // 4


def gloo_bytes_per_s(group: dist.ProcessGroup, sender: int, receiver: int, nbytes: int) -> float | None:
    """Sender -> receiver bandwidth over their pair group, known on the receiver (None on the sender)."""
    head, tail = (torch.zeros(size, dtype=torch.uint8) for size in _split(nbytes))
    ack = torch.zeros(1, dtype=torch.uint8)
    if dist.get_rank() == sender:
        sends = [dist.isend(part, receiver, group=group) for part in (head, tail)]
        for work in sends:
            work.wait()
        dist.recv(ack, receiver, group=group)
        return None
    dist.recv(head, sender, group=group)
    start = time.perf_counter()
    dist.recv(tail, sender, group=group)
    elapsed = time.perf_counter() - start
    dist.send(ack, sender, group=group)
    return tail.numel() / elapsed


def socket_bytes_per_s(is_sender: bool, own_address: str, peer_address: str, nbytes: int, tag: str) -> float | None:
    """The same over a plain TCP connection: the receiver listens on its address, the sender binds its own."""
    store = dist.PrefixStore(f"holmes-lab/{tag}", dist.distributed_c10d._get_default_store())
    head, tail = _split(nbytes)
    if is_sender:
        port = int(store.get("port"))
        with socket.create_connection((peer_address, port), source_address=(own_address, 0)) as connection:
            connection.sendall(bytes(nbytes))
            _receive_exactly(connection, 1)
        return None
    with socket.create_server((own_address, 0)) as server:
        store.set("port", str(server.getsockname()[1]))
        connection, _ = server.accept()
    with connection:
        _receive_exactly(connection, head)
        start = time.perf_counter()
        _receive_exactly(connection, tail)
        elapsed = time.perf_counter() - start
        connection.sendall(b"k")
    return tail / elapsed


def _receive_exactly(connection: socket.socket, size: int) -> None:
    buffer = bytearray(min(size, 1 << 20))
    left = size
    while left:
        got = connection.recv_into(buffer, min(left, len(buffer)))
        if not got:
            raise ConnectionError(f"peer closed the probe connection with {left} of {size} bytes still to come")
        left -= got
