"""`python -m holmes_lightning.bench [bench=short|full] [bench.variants=[...]]`: every variant in the lab, one run.

Writes results.md, results.json and results.png into the run directory (outputs/bench/<time>/) and prints the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from holmes_lightning.bench.config import BenchJobConfig, register_bench_configs
from holmes_lightning.bench.report import draw, markdown, regime, write_json
from holmes_lightning.bench.runner import run_bench
from holmes_lightning.config import register_configs
from holmes_lightning.topology import Topology, config_dir

register_configs()
register_bench_configs()


def run(config: BenchJobConfig, out_dir: Path) -> Path:
    """Run the benchmark and write its outputs; returns the Markdown file."""
    settings = config.bench
    hybrid = Topology.from_config(config.cluster)
    results, context = run_bench(hybrid, settings, out_dir)
    model = settings.model
    context.update(
        bench=settings.name,
        model=f"GPT {model.n_layers}x{model.d_model} (heads {model.n_heads}, seq {model.seq_len})",
        global_batch=settings.global_batch,
        steps=f"{settings.warmup_steps} warm-up + {settings.measured_steps} measured steps",
    )
    check = regime(context["variants"], context["profile"], settings.global_batch)
    table = markdown(results, context, check)
    (out_dir / "results.md").write_text(table)
    write_json(out_dir / "results.json", results, context, check)
    draw(out_dir / "results.png", results)
    print(table)
    print(f"bench: wrote {out_dir / 'results.md'}, results.json and results.png")
    return out_dir / "results.md"


@hydra.main(version_base=None, config_path=str(config_dir()), config_name="benchmark")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        config: BenchJobConfig = OmegaConf.to_object(cfg)
    except ValueError as err:  # ConfigError from the schema's checks
        sys.exit(f"bench: {err}")
    run(config, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    _hydra_main()
