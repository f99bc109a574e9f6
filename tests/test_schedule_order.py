"""The planner's per-stage action orders against the order torch.distributed.pipelining's schedules actually run.

torch's single-stage schedules (GPipe, 1F1B) hard-code their order in `_step_microbatches`; their `pipeline_order`
is a separate description that the step never reads. Only a real step shows what runs, so one 3-rank gloo launch
steps every case below with stages that note each forward and backward torch asks of them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from holmes_lightning.planner.options import Schedule
from holmes_lightning.planner.plan_types import virtual_stage
from holmes_lightning.planner.schedules import FULL, INPUT, WEIGHT, stage_actions

WORLD = 3
ONE_NODE = {
    "name": "one_node",
    "devices_per_node": WORLD,
    "clusters": [{"name": "local", "nodes": 1, "nic": {"kind": "ethernet"}}],
}
CASES = [  # (schedule, pp, micro-batches, chunks per rank)
    ("GPipe", 2, 1, 1),
    ("GPipe", 3, 5, 1),
    ("1F1B", 2, 2, 1),
    ("1F1B", 3, 3, 1),
    ("1F1B", 3, 7, 1),
    ("Interleaved1F1B", 2, 4, 2),
    ("Interleaved1F1B", 2, 6, 3),
    ("Interleaved1F1B", 3, 2, 2),  # fewer micro-batches than stages: one round of 2
    ("Interleaved1F1B", 3, 6, 2),  # two rounds of 3
    ("Interleaved1F1B", 3, 8, 2),  # two rounds of 4: more micro-batches per round than stages
    ("Interleaved1F1B", 3, 6, 4),
    ("InterleavedZeroBubble", 2, 4, 2),
    ("InterleavedZeroBubble", 3, 2, 2),  # fewer micro-batches than stages: torch adds bubbles, the order stays
    ("InterleavedZeroBubble", 3, 6, 2),
    ("InterleavedZeroBubble", 3, 8, 2),
    ("InterleavedZeroBubble", 3, 3, 1),  # one chunk per rank: ZB1P
    ("ZBVZeroBubble", 2, 4, 2),
    ("ZBVZeroBubble", 3, 2, 2),  # fewer micro-batches than 2 pp - 1: torch drops the missing ones' actions
    ("ZBVZeroBubble", 3, 7, 2),
    ("DualPipeV", 2, 4, 2),
    ("DualPipeV", 3, 6, 2),
    ("DualPipeV", 3, 9, 2),
]


class RecordingStage(PipelineStage):
    """A PipelineStage that notes (backward, chunk, micro-batch, part) of every forward and backward the schedule runs
    (a backward's part: all of it, its input pass or its weight pass)."""

    def __init__(self, *args, record: list[tuple[bool, int, int, str]], chunk: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.record, self.chunk = record, chunk

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self.record.append((False, self.chunk, fwd_chunk_id, FULL))
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, full_backward: bool = True, **kwargs):
        self.record.append((True, self.chunk, bwd_chunk_id, FULL if full_backward else INPUT))
        return super().backward_one_chunk(bwd_chunk_id, *args, full_backward=full_backward, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self.record.append((True, self.chunk, bwd_chunk_id, WEIGHT))
        return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


def run_orders(cases: list[list]) -> list[list[tuple[bool, int, int, str]] | None]:
    """On each rank: one training step of every case on ranks 0..pp-1; this rank's order per case (None: idle)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {pp: dist.new_group(list(range(pp))) for pp in sorted({case[1] for case in cases})}
    orders = []
    for schedule, pp, microbatches, chunks in cases:
        if rank >= pp:
            orders.append(None)
            continue
        record: list[tuple[bool, int, int, str]] = []
        stages = [
            RecordingStage(
                nn.Linear(4, 4),
                # loop placement: a rank holds stages rank, rank + pp, ...; V placement: rank and 2 pp - 1 - rank
                stage_index=virtual_stage(rank, chunk, pp, v_shaped=Schedule(schedule).v_shaped),
                num_stages=pp * chunks,
                device=torch.device("cpu"),
                group=groups[pp],
                record=record,
                chunk=chunk,
            )
            for chunk in range(chunks)
        ]
        schedule_class = get_schedule_class(schedule)
        loss = nn.functional.mse_loss
        if issubclass(schedule_class, PipelineScheduleSingle):
            runner = schedule_class(stages[0], n_microbatches=microbatches, loss_fn=loss)
        else:
            runner = schedule_class(stages, n_microbatches=microbatches, loss_fn=loss)
        batch = torch.randn(2 * microbatches, 4)
        last = any(stage.is_last for stage in stages)
        runner.step(batch if rank == 0 else None, target=batch if last else None)
        orders.append(record)
    dist.destroy_process_group()
    return orders


@pytest.fixture(scope="module")
def torch_orders() -> list[list]:
    """Per case, per rank: the order torch ran (JSON turns the tuples into lists)."""
    by_rank = run_ranks("test_schedule_order:run_orders", cluster=ONE_NODE, cases=CASES)
    return [[by_rank[rank][case] for rank in range(WORLD)] for case in range(len(CASES))]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)), ids=["{}-pp{}-m{}-v{}".format(*case) for case in CASES])
def test_planner_orders_are_the_orders_torch_runs(case: int, torch_orders: list[list]) -> None:
    schedule, pp, microbatches, chunks = CASES[case]
    for stage in range(pp):
        planned = [
            [a.backward, a.chunk, a.microbatch, a.part]
            for a in stage_actions(schedule, stage, pp, microbatches, chunks)
        ]
        assert planned == torch_orders[case][stage], f"stage {stage}"
    assert torch_orders[case][pp:] == [None] * (WORLD - pp)
