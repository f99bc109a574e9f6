"""Multi-process test runs: `run_ranks` starts one process per rank of a cluster and collects what each returns.

Each rank is a process of its own with torchrun's variables, as `holmes_lightning.launch.processes` sets them for a
job on this machine (gloo, loopback); it calls MODULE:FUNCTION with the keyword arguments and writes its JSON result
to OUT/rank<N>.json. By default the ranks are forked from one server process that imported Lightning once per test
session (a fresh interpreter spends ~5 s of CPU on that import, most of a small test's time); `launcher=True` runs
`python tests/distributed.py MODULE:FUNCTION KWARGS OUT` under the launcher itself, for tests of its supervision.
Also here: a tiny LightningModule that follows the pipeline contract, and its data, so equivalence tests compare the
same model in and out of HolmesStrategy.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from holmes_lightning.launch.processes import free_port, launch, process_env, rank_env
from holmes_lightning.launch.shutdown import skip_exit_collections
from holmes_lightning.topology import Topology

FEATURES, CLASSES = 8, 4
WIDTHS = (FEATURES, 48, 48, 16, 16, 16, CLASSES)  # wide first layers: an auto partition differs from uniform

# The server imports HolmesStrategy (and Lightning) once, from the installed package: on Python 3.11 it does not
# see tests/ on its path, each rank imports this module after the fork.
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(["holmes_lightning.runtime", "holmes_lightning.launch.processes"])


def run_ranks(
    target: str,
    cluster: str | dict = "two_cluster_mixed",
    timeout_s: float = 300,
    env: dict[str, str] | None = None,
    launcher: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run `target` ("module:function", module importable from tests/) on every rank; returns results by rank.

    `env`: variables every rank gets on top of this process's; `launcher`: start the ranks with `launch` (a fresh
    interpreter each) rather than forking them."""
    topology = Topology.from_config(cluster)
    with tempfile.TemporaryDirectory() as out:
        with deadline(timeout_s, f"{target} on {topology.world_size} ranks"):
            if launcher:
                command = [sys.executable, str(Path(__file__).resolve()), target, json.dumps(kwargs), out]
                code = launch(command, topology, node_env=(lambda _node: env) if env else None, grace_s=5)
            else:
                code = _run_forked(target, kwargs, out, topology, env or {}, timeout_s)
        if code != 0:
            raise RuntimeError(f"{target} failed on some rank with exit code {code} (rank output is above)")
        return [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(topology.world_size)]


def _run_forked(
    target: str, kwargs: dict[str, Any], out: str, topology: Topology, env: dict[str, str], timeout_s: float
) -> int:
    """Each rank forked from the preloaded server with `launch`'s variables; once one fails the others get SIGUSR1
    (each prints its threads' Python stacks into its log), then SIGTERM and, after 5 s, SIGKILL. Near the test's
    deadline every rank still running prints its stacks by itself (`_forked_rank`). Returns 0, or a failed rank's
    code (one killed by signal N first, as 128 + N). Each rank's output is printed here, after the job, to this
    process's stderr, with whether it had returned its result."""
    port = free_port()
    ranks = []
    for rank in range(topology.world_size):
        environment = process_env(rank_env(topology, rank, "127.0.0.1", port), env)
        # not daemonic: a rank may start processes of its own (DataLoader workers)
        ranks.append(
            _FORKS.Process(target=_forked_rank, args=(target, kwargs, out, environment, timeout_s), daemon=False)
        )
    try:
        for process in ranks:
            process.start()
        failures: list[int] = []
        while not failures and any(process.exitcode is None for process in ranks):
            multiprocessing.connection.wait([process.sentinel for process in ranks if process.exitcode is None])
            failures = [process.exitcode for process in ranks if process.exitcode]
        code = min(failures, key=lambda c: c > 0, default=0)  # a rank killed by a signal likely failed the others
        return code if code >= 0 else 128 - code
    finally:
        running = [process for process in ranks if process.exitcode is None]
        for process in running:  # where each was stuck, into its log (`_forked_rank`), before it is stopped
            os.kill(process.pid, signal.SIGUSR1)
        if running:
            time.sleep(1)
        for process in running:
            process.terminate()
        grace_ends = time.monotonic() + 5
        for process in ranks:
            process.join(timeout=max(0.0, grace_ends - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join()
        for rank, process in enumerate(ranks):
            log, returned = Path(out, f"rank{rank}.log"), Path(out, f"rank{rank}.json").exists()
            state = f"exit code {process.exitcode}" if process not in running else "stopped here"
            text = log.read_text() if log.exists() else ""
            print(
                f"--- rank {rank} ({state}, result {'returned' if returned else 'not returned'}) ---\n{text}",
                file=sys.stderr,
                end="",
                flush=True,
            )


def _forked_rank(target: str, kwargs: dict[str, Any], out: str, environment: dict[str, str], timeout_s: float) -> None:
    """A forked rank: its whole environment (`process_env`) and output file, then the target (`_main`). Its stacks
    go to its log on SIGUSR1 and, from a timer, shortly before the test's deadline: Lightning's Trainer sets every
    signal's handler back to what Python saw at its start when it tears down, which undoes the SIGUSR1 one."""
    os.environ.clear()
    os.environ.update(environment)
    torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))
    log = os.open(Path(out, f"rank{environment['RANK']}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for stream in (1, 2):
        os.dup2(log, stream)
    os.close(log)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 10))
    _main(target, json.dumps(kwargs), out)


@contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise TimeoutError in the block once it has run `seconds`: a guard against a hang, not a speed check."""

    def expire(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"{what} ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def one_rank_fails_while_the_others_wait(failing_rank: int, failure: str, ready_dir: Path) -> list[str]:
    """A command for every rank: each rank but `failing_rank` prints its pid and waits until a signal stops it
    (SIGTERM: it says so on stderr); `failing_rank` runs the Python statement `failure` once all the others wait."""
    script = f"""
import os, signal, sys, time
from pathlib import Path
rank, world, ready = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), Path({str(ready_dir)!r})
if rank == {failing_rank}:
    while len(list(ready.iterdir())) < world - 1:
        time.sleep(0.05)
    {failure}
signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"rank {{rank}} stopped by SIGTERM"))
os.write(1, f"{{os.getpid()}}\\n".encode())  # one write: the ranks' lines never interleave
(ready / str(rank)).touch()
signal.pause()
"""
    return [sys.executable, "-c", script]


class TinyMLP(L.LightningModule):
    """An MLP classifier as pipeline layers; the same code trains on one device or as pipeline stages."""

    def __init__(self, lr: float = 0.02, step_size: int = 5, widths: tuple[int, ...] = WIDTHS) -> None:
        super().__init__()
        self.save_hyperparameters()
        pairs = zip(widths[:-1], widths[1:], strict=True)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in pairs)
        self.layers[-1] = nn.Linear(widths[-2], CLASSES)
        self.example_input_array = torch.zeros(2, FEATURES)

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs, targets)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            inputs = layer(inputs)
        return inputs

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.pipeline_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.pipeline_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=self.hparams.step_size, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def quiet_trainer(**settings: Any) -> L.Trainer:
    """A CPU Trainer that writes nothing (no logger, checkpoints, progress bar or summary), with `settings`."""
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return L.Trainer(accelerator="cpu", enable_model_summary=False, **{**quiet, **settings})


def tiny_dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    targets = (inputs[:, :CLASSES] + 0.5 * torch.randn(samples, CLASSES, generator=generator)).argmax(dim=1)
    return TensorDataset(inputs, targets)


def tiny_loader(
    samples: int, batch_size: int, shuffle: bool = True, single_process_seed: int | None = None
) -> DataLoader:
    """Batches of `tiny_dataset`.

    `single_process_seed`: on one process, the order Lightning's seeded DistributedSampler gives a job's DP replicas
    together, so that one batch here is their global batch.
    """
    dataset = tiny_dataset(samples)
    if single_process_seed is None:
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=True)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=single_process_seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)


class LossRecorder(L.Callback):
    """The loss Lightning receives from each training step (what `training_step` returned)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def _main(target: str, kwargs: str, out: str) -> None:
    skip_exit_collections()
    module_name, function_name = target.split(":")
    result = getattr(importlib.import_module(module_name), function_name)(**json.loads(kwargs))
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    if dist.is_initialized():  # every group ends here, as train.py ends them, not in the interpreter's teardown
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(*sys.argv[1:])
