"""Which files the package holds: every `holmes_lightning` package, and the repository's `conf/` as its `conf/`.

The Hydra configs have one home, the top-level `conf/`; a wheel carries them inside the package, where
`holmes_lightning.topology.config_dir()` finds them. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["holmes_lightning", "holmes_lightning.*"]), "holmes_lightning.conf"],
    package_dir={"holmes_lightning.conf": "conf"},
    package_data={"holmes_lightning.conf": ["*.yaml", "*/*.yaml"]},
)
