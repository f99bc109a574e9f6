"""Bad input stops the job before any process group exists, with one `error:` line naming the field, value and fix.

Hypothesis feeds malformed cluster configs to `Topology.from_config` and malformed requests to the planner (they must
either work or raise their own error, never anything else), and a few malformed overrides to `train.py` itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_checkpoint import save

from holmes_lightning.cli.config import ModelConfig
from holmes_lightning.planner import (
    BatchSettings,
    ModelProfile,
    Plan,
    PlanError,
    PlanOptions,
    Schedule,
    SettingError,
    best_plan,
)
from holmes_lightning.topology import NICKind, Topology, TopologyError

ROOT = Path(__file__).resolve().parents[1]
KINDS = [kind.value for kind in NICKind]
NUMBERS = st.one_of(
    st.integers(-3, 4), st.floats(allow_nan=True, allow_infinity=True), st.just("many"), st.none(), st.booleans()
)


def clusters() -> st.SearchStrategy[dict]:
    """Cluster configs with every field sometimes wrong: bad counts, unknown NIC kinds, wrong types, unknown keys."""
    group = st.fixed_dictionaries(
        {
            "name": st.one_of(st.sampled_from(["A", "B"]), st.just(""), st.none()),
            "nodes": NUMBERS,
            "nic": st.fixed_dictionaries(
                {
                    "kind": st.one_of(st.sampled_from(KINDS), st.text(max_size=8), st.none(), st.integers()),
                    "gbps": NUMBERS,
                }
            ),
        },
        optional={"devices_per_node": NUMBERS, "hostnames": st.lists(st.text(max_size=4), max_size=3), "typo": NUMBERS},
    )
    return st.fixed_dictionaries(
        {"name": st.text(max_size=6), "clusters": st.lists(group, max_size=3)},
        optional={"devices_per_node": NUMBERS, "intra_node": st.fixed_dictionaries({"gbps": NUMBERS})},
    )


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_a_malformed_cluster_is_a_topology_error_that_names_the_field(config: dict) -> None:
    try:
        topology = Topology.from_config(config)
    except TopologyError as err:
        assert str(err).startswith("cluster"), err  # cluster.<field>=<value>: <fix>, or cluster '<name>': ...
        return
    assert topology.world_size == sum(len(node.ranks) for node in topology.nodes) > 0
    assert all(node.nic_gbps > 0 and node.nic.value in KINDS for node in topology.nodes)


SHIPPED = ("two_cluster_mixed", "three_cluster", "single_node")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cluster=st.sampled_from(SHIPPED),
    n_layers=st.integers(1, 6),
    global_batch=st.integers(-2, 40),
    microbatches=st.one_of(st.none(), st.integers(-1, 20)),
    pp=st.one_of(st.none(), st.integers(-1, 9)),
    dp=st.one_of(st.none(), st.integers(-1, 9)),
    schedule=st.one_of(st.sampled_from(list(Schedule)), st.text(max_size=6)),
    partition=st.one_of(st.sampled_from(["auto", "uniform", "best"]), st.lists(st.integers(-1, 5), max_size=5)),
    memory_limit_gb=st.one_of(st.none(), st.floats(-1, 100)),
)
def test_a_request_the_cluster_cannot_run_is_a_plan_error_that_names_the_setting(
    cluster: str, n_layers: int, **request: object
) -> None:
    topology = Topology.from_config(cluster)
    profile = ModelProfile.from_gpt(ModelConfig(n_layers=n_layers, d_model=64, n_heads=4, seq_len=32))
    try:
        batch = BatchSettings(request.pop("global_batch"), request.pop("microbatches"))
        plan = best_plan(topology, profile, batch, options=PlanOptions(**request))
    except SettingError as err:  # wrong whatever the hardware: refused where it was written
        assert re.match(r"(BatchSettings|PlanOptions)\(\w+=", str(err)), err
        return
    except PlanError as err:
        assert re.search(r"\b(global_batch|microbatches|pp|dp|partition|memory_limit_gb)=", str(err)), err
        return
    assert isinstance(plan, Plan) and plan.world_size == topology.world_size
    assert plan.microbatches * plan.microbatch_size * plan.dp == batch.global_batch


def train_py(*overrides: str, timeout: int = 180) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "train.py", *overrides]
    return subprocess.run(argv, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout)


def assert_clean_error(code: int | str | None, stdout: str, stderr: str, message: str) -> None:
    """Exit code 2, one `error: ` message (last in the output) that has `message`, no traceback, no rank started."""
    assert code == 2, stderr[-3000:]
    before, _, error = stderr.partition("error: ")
    assert message in error and "error: " not in error and not before.strip(), stderr[-3000:]
    assert "Traceback" not in stderr and "starting" not in stdout


def run_cli(train_module: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str):
    """`python train.py ARGS` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()  # what the test printed before (e.g. DCP's single-process warning) is not train.py's
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # cli() sets it; monkeypatch puts the old value back
    with pytest.raises(SystemExit) as exited:
        train_module.cli()
    out, err = capsys.readouterr()
    return exited.value.code, out, err


TORCHRUN_ENV = {  # what torchrun sets for rank 0 of a 3-process job
    "RANK": "0",
    "LOCAL_RANK": "0",
    "GROUP_RANK": "0",
    "WORLD_SIZE": "3",
    "LOCAL_WORLD_SIZE": "3",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29511",
    "TORCHELASTIC_RUN_ID": "bad-input",
}


def damaged_checkpoint(directory: Path) -> Path:
    path = save(directory, 6)
    next(path.glob("*.distcp")).write_bytes(b"")
    return path


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        (
            ["cluster.clusters.1.nic.kind=myrinet"],
            {},
            "nic.kind=myrinet: Invalid value 'myrinet', expected one of [infin",
        ),
        (["cluster.clusters.0.nodes=two"], {}, "Error merging override cluster.clusters.0.nodes=two: Value 'two'"),
        (["strategy.pp=3"], {}, "pp=3 does not divide the 4 ranks of 'two_cluster_mixed'; use a divisor"),
        (["strategy.pp=2", "strategy.microbatches=3"], {}, "microbatches=3 does not divide the 8 samples"),
        (
            ["strategy.schedule=ZeroBubble"],
            {},
            "strategy.schedule=ZeroBubble: Invalid value 'ZeroBubble'",
        ),
        (["strategy.pp=0"], {}, "strategy.pp=0: use a positive number of stages"),
        (["strategy.costs.latency_s=-1"], {}, "strategy.costs.latency_s=-1.0: use seconds >= 0"),
        (["data.global_batch=6", "strategy.dp=4"], {}, "dp=4: every stage must hold one NIC kind"),
        (["cluster=single_node"], TORCHRUN_ENV, "world size 3 from the launcher does not match cluster 'single_node'"),
        (["resume=/a/step=6.ckpt"], {}, "resume=/a/step=6.ckpt: mismatched input '=' expecting <EOF> (quote a value"),
        (["strategy.memory_limit_gb=0.001"], {}, "fits memory_limit_gb=0.001 per device; use more stages"),
        (
            ["strategy.layout=megatron"],
            {},
            "strategy.layout=megatron: Invalid value 'megatron'",
        ),
    ],
    ids=[
        "unknown NIC kind",
        "wrong type",
        "stages",
        "micro-batches",
        "schedule",
        "no stages",
        "negative cost",
        "dp",
        "world size",
        "unquoted path",
        "memory limit",
        "layout",
    ],
)
def test_train_py_refuses_bad_settings_before_any_rank_starts(
    overrides: list[str], env: dict[str, str], message: str, tmp_path: Path, train_module, monkeypatch, capsys
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert_clean_error(*run_cli(train_module, monkeypatch, capsys, *overrides, f"output_dir={tmp_path}"), message)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (damaged_checkpoint, "is corrupt: shard __0_0.distcp has 0 of its"),
        (lambda d: save(d, 3), "holds a model of 4 pipeline layers, this run has 6; resume with the same model"),
        (lambda d: d / "step_000009.ckpt", "no such checkpoint directory; start without resume (resume=null)"),
    ],
    ids=["corrupt checkpoint", "checkpoint of another model", "missing checkpoint"],
)
def test_train_py_refuses_a_checkpoint_it_cannot_resume(
    make, message: str, tmp_path: Path, train_module, monkeypatch, capsys
) -> None:
    path = make(tmp_path)
    assert_clean_error(*run_cli(train_module, monkeypatch, capsys, f"resume={path}", f"output_dir={tmp_path}"), message)


MALFORMED = st.one_of(
    st.integers(-5, 0).map(lambda n: f"cluster.clusters.0.nodes={n}"),
    st.sampled_from(["ib", "RDMA", "nvlink", "''"]).map(lambda kind: f"cluster.clusters.0.nic.kind={kind}"),
    st.sampled_from([3, 5, 6, 7, 8, 64]).map(lambda pp: f"strategy.pp={pp}"),
    st.sampled_from([17, 19, 23, 31]).map(lambda m: f"strategy.microbatches={m}"),
    st.integers(-4, 0).map(lambda b: f"data.global_batch={b}"),
    st.sampled_from(["GPipes", "1f1b", "ZB"]).map(lambda s: f"strategy.schedule={s}"),
    st.sampled_from([3, 5, 7, 6]).map(lambda h: f"model.n_heads={h}"),
    st.sampled_from(["four", "1.5", "[2]"]).map(lambda v: f"model.n_layers={v}"),
    st.floats(-1, 0).map(lambda lr: f"trainer.learning_rate={lr}"),
)


@pytest.mark.slow
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(override=MALFORMED)
def test_random_malformed_overrides_give_one_clean_error(override: str, tmp_path: Path) -> None:
    """As a real `python train.py` process: exit code, output and the time it takes (the timeout: never a hang)."""
    result = train_py(override, f"output_dir={tmp_path}")
    assert_clean_error(result.returncode, result.stdout, result.stderr, override.split("=")[0].split(".")[-1])
