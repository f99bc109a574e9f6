"""Replicas' gradient buckets: every gradient once, in order, one dtype per bucket, each bucket within the limit."""

import torch

from holmes_lightning.runtime import sharding


def test_buckets_keep_order_split_by_dtype_and_respect_the_size_limit(monkeypatch):
    monkeypatch.setattr(sharding, "BUCKET_BYTES", 100)
    grads = [torch.zeros(10), torch.zeros(10, dtype=torch.bfloat16), torch.zeros(10), torch.zeros(30), torch.zeros(5)]
    buckets = list(sharding._buckets(grads))
    assert [[id(g) for g in b] for b in buckets] == [
        [id(grads[0]), id(grads[2])],  # 40 + 40 bytes; the next float32 tensor would pass 100
        [id(grads[3])],  # 120 bytes alone: a tensor larger than the limit gets a bucket of its own
        [id(grads[4])],
        [id(grads[1])],
    ]
    assert all(len({g.dtype for g in b}) == 1 for b in buckets)
