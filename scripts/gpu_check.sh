#!/usr/bin/env bash
# GPU check for HolmesStrategy on one CUDA device (a few minutes at most). Each part is a fresh process:
#   1. NCCL process groups as the runtime builds them: net_name "Socket" and "IB" per group, an all-reduce on each;
#   2. a real bf16 training run with pp=1 (FSDP2 over a one-rank NCCL mesh) through Lightning's Trainer;
#   3. a 2-stage pipeline on the same device (pp=1, Interleaved1F1B: two virtual stages on one rank), bf16.
# Prints "gpu_check: PASSED" at the end; any failure stops it with a non-zero exit code.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
LIMIT="${GPU_CHECK_PART_TIMEOUT:-240}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version(), 'lightning', lightning.__version__); assert torch.cuda.is_available()"

echo "gpu_check 1/3: NCCL groups with a network per group"
timeout "$LIMIT" python - <<'EOF'
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from holmes_lightning.runtime.groups import Transport, new_group
from holmes_lightning.topology import LinkKind

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("GPU_CHECK_PORT", "29561"))
torch.cuda.set_device(0)
world_options = dist.ProcessGroupNCCL.Options()
world_options.config.net_name = "Socket"
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0), pg_options=world_options)
results = {}
for link in (LinkKind.TCP, LinkKind.RDMA, LinkKind.INTRA_NODE):
    transport = Transport(link, None)
    try:
        group = new_group((0,), "nccl", transport, timedelta(seconds=60))
        value = torch.ones(4, device="cuda")
        dist.all_reduce(value, group=group)
        torch.cuda.synchronize()
        results[transport.nccl_net] = "ok" if value.sum().item() == 4 else f"wrong sum {value.sum().item()}"
    except Exception as error:  # report every net, then fail below
        results[transport.nccl_net] = f"{type(error).__name__}: {error}"
print("  nccl net_name per group:", results)
dist.destroy_process_group()
assert results["Socket"] == "ok" and results[None] == "ok", results
if results["IB"] != "ok":
    print("  note: net_name='IB' failed here (no InfiniBand/RoCE NIC on this machine?); in-fabric groups need one")
EOF

cat > /tmp/holmes_gpu_check_fit.py <<'EOF'
"""Fit the GPT recipe on one GPU with HolmesStrategy; argv[1] = schedule, argv[2] = expected (pp, chunks)."""
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from holmes_lightning import HolmesStrategy
from recipes import GPT

schedule, steps, batch, seq = sys.argv[1], 12, 8, 256
L.seed_everything(0)
model = GPT(n_layers=4, d_model=256, n_heads=4, seq_len=seq, warmup_steps=2)
starts = torch.randint(0, 256, (steps * batch, 1))
tokens = (starts + torch.arange(seq + 1)) % 256  # counting sequences: learnable, so the loss must fall
cluster = {"name": "one_gpu", "clusters": [{"name": "local", "nodes": 1, "nic": {"kind": None}}]}
strategy = HolmesStrategy(cluster=cluster, schedule=schedule, global_batch=batch, microbatches=4, timeout=120)


class Losses(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, module, outputs, *args):
        self.values.append(float(outputs["loss"]))


losses = Losses()
trainer = L.Trainer(
    accelerator="gpu",
    devices=1,
    strategy=strategy,
    precision="bf16-mixed",
    max_steps=steps,
    gradient_clip_val=1.0,
    limit_val_batches=2,
    val_check_interval=6,
    num_sanity_val_steps=0,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    callbacks=[losses],
)
data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
trainer.fit(model, DataLoader(data, batch_size=batch), DataLoader(data, batch_size=batch))
plan = strategy.plan
print(f"  {schedule}: plan pp={plan.pp} x dp={plan.dp}, chunks {[s.chunks for s in plan.stages]}, pipelined: "
      f"{strategy.pipeline is not None}; sharded param dtype: {next(model.parameters()).dtype}")
print(f"  losses {[round(v, 3) for v in losses.values]}; val_loss {float(trainer.callback_metrics['val_loss']):.3f}")
print(f"  peak memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
assert len(losses.values) == steps and all(torch.isfinite(torch.tensor(losses.values)))
assert losses.values[-1] < losses.values[0], "the loss did not go down"
assert (strategy.pipeline is not None) == (sys.argv[2] == "pipelined")
EOF

echo "gpu_check 2/3: pp=1, FSDP2 on NCCL, bf16-mixed, a real training run"
timeout "$LIMIT" python /tmp/holmes_gpu_check_fit.py 1F1B fsdp-only
echo "gpu_check 3/3: a 2-stage pipeline on this one device (Interleaved1F1B, pp=1), bf16-mixed"
timeout "$LIMIT" python /tmp/holmes_gpu_check_fit.py Interleaved1F1B pipelined
rm -f /tmp/holmes_gpu_check_fit.py
echo "gpu_check: PASSED"
