"""bench=elastic's reading of its job: the phases, plans and speeds from the output of one real run (three_cluster in
the lab, rank 7 killed 0.5 s after the step-12 checkpoint; tests/data/elastic_job.log, the lines the bench reads and
some it must skip) and that run's checkpoint times."""

from __future__ import annotations

from pathlib import Path

import pytest

from holmes_lightning.bench.config import BenchSettings, ElasticJob
from holmes_lightning.bench.elastic import ElasticResult, draw, launch_speeds, markdown
from holmes_lightning.bench.elastic_log import PHASES, Line, Save, lab_scales, phases, plans, speed, summary
from holmes_lightning.cli.config import ConfigError

LOG = Path(__file__).parent / "data" / "elastic_job.log"
KILLED_AT = 1796432249.7017238  # when the bench sent SIGKILL
TOKENS_PER_STEP = 16 * 128
SAVES = [  # step, ranks, save started, save ended (the run's checkpoint files)
    Save(4, 8, 1796432178.7141447, 1796432187.077365),
    Save(8, 8, 1796432209.886942, 1796432217.984952),
    Save(12, 8, 1796432240.9945967, 1796432249.1779137),
    Save(16, 6, 1796432287.0761387, 1796432292.143691),
    Save(20, 6, 1796432303.2383964, 1796432308.5414338),
    Save(24, 6, 1796432319.6145961, 1796432323.9789374),
    Save(28, 6, 1796432335.0840192, 1796432340.4470003),
]


def read_log() -> list[Line]:
    stamped = (raw.partition(" ") for raw in LOG.read_text().splitlines())
    return [Line(float(at), text) for at, _, text in stamped]


def test_the_phases_run_from_the_kill_to_the_first_step_after_the_resume_without_gaps():
    found = phases(read_log(), KILLED_AT)
    assert [p.name for p in found] == [name for name, _, _ in PHASES]
    assert found[0].start == KILLED_AT
    assert all(later.start == earlier.end for earlier, later in zip(found, found[1:], strict=False))
    by_name = {p.name: p for p in found}
    assert by_name["detection"].seconds == pytest.approx(1796432249.856 - KILLED_AT)
    # the first launch's registration and plan came before the kill: the restarted ranks' end the phases
    assert by_name["start-up"].ended_by == "All distributed processes registered. Starting with 6 processes"
    assert by_name["planning"].ended_by.startswith("holmes plan: pp=3 x dp=2")
    assert by_name["checkpoint load"].seconds == pytest.approx(1796432275.592 - 1796432274.096)
    assert found[-1].end - KILLED_AT == pytest.approx(1796432278.770 - KILLED_AT)


def test_a_phase_whose_line_never_came_is_named():
    without_first_step = [line for line in read_log() if "the first since resuming" not in line.text]
    with pytest.raises(ValueError, match="first step never ended"):
        phases(without_first_step, KILLED_AT)


def test_each_launch_has_its_plan_prediction_and_link_scale():
    lines = read_log()
    found = plans(lines)
    assert [p.layout for p in found] == [
        "pp=4 x dp=2, 1F1B, 8 micro-batches of 1, none, partition auto",
        "pp=3 x dp=2, 1F1B, 8 micro-batches of 1, none, partition auto",
    ]
    assert [(p.predicted_step_s, p.predicted_tokens_per_s) for p in found] == [(6.186, 331.0), (2.345, 874.0)]
    assert lab_scales(lines) == ["1/11000", "1/8000"]
    assert summary(lines) == (740.0, 874.0)
    assert summary(lines[:-2]) is None  # the killed launch prints none


def test_speed_is_measured_between_checkpoints_of_one_launch_saves_left_out():
    before, after = launch_speeds(read_log(), SAVES, KILLED_AT, TOKENS_PER_STEP)
    training_s = (SAVES[1].started - SAVES[0].ended) + (SAVES[2].started - SAVES[1].ended)
    assert (before.ranks, before.measured.steps, before.measured.seconds) == (8, 8, pytest.approx(training_s))
    assert before.measured.tokens_per_s == pytest.approx(8 * TOKENS_PER_STEP / training_s)
    assert (after.ranks, after.measured.steps) == (6, 12)  # from the first checkpoint after the resume
    assert after.predicted_tokens_per_s == 874.0 and after.links == "1/8000"
    with pytest.raises(ValueError, match="tokens/s need two"):
        speed(SAVES[:1], TOKENS_PER_STEP)


def test_the_report_shows_every_phase_and_both_launches(tmp_path, saved_figures):
    lines = read_log()
    result = ElasticResult(
        cluster="three_cluster",
        killed_rank=7,
        restart=next(line.text for line in lines if " lost; restart " in line.text),
        phases=phases(lines, KILLED_AT),
        launches=launch_speeds(lines, SAVES, KILLED_AT, TOKENS_PER_STEP),
        summary=summary(lines),
    )
    job = ElasticJob()
    table = markdown(
        [result], BenchSettings(name="elastic", kind="elastic", variants=["three_cluster"], elastic=job), job
    )
    assert all(f"| {name} |" in table for name, _, _ in PHASES)
    assert f"**{result.total_s:.2f}**" in table and "| before the kill | 8 |" in table and "(0.85)" in table
    draw(tmp_path / "elastic.png", [result])
    timeline, _ = saved_figures[0].axes
    assert len(timeline.patches) == len(PHASES)


def test_bad_elastic_settings_name_the_field():
    with pytest.raises(ConfigError, match="bench.elastic.checkpoints_before"):
        ElasticJob(checkpoints_before=1)
    with pytest.raises(ConfigError, match="bench.elastic"):
        BenchSettings(kind="elastic", variants=["three_cluster"])
    with pytest.raises(ConfigError, match="bench.variants"):
        BenchSettings(kind="elastic", variants=["no_such_cluster"], elastic=ElasticJob())
