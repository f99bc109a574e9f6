"""Your own classes in train.py's config: `model._target_=my_package.MyModule +model.some_arg=3` (and `data._target_`).

The class is built by `hydra.utils.instantiate` from the keys added to its node with `+` (the schema's own fields
are train.py's); before any rank starts, it must import, be of the right kind and accept those keys.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from holmes_lightning.cli.config import ConfigError


def added_keys(node: DictConfig) -> dict[str, Any]:
    """The keys added with `+KEY=VALUE` to a node of a structured config, which `OmegaConf.to_object` drops."""
    known = {f.name for f in fields(OmegaConf.get_type(node))}
    values = OmegaConf.to_container(node, resolve=True)
    return {key: value for key, value in values.items() if key not in known}


def check_target(node: str, target: str | None, kind: type, arguments: Mapping[str, Any]) -> None:
    """`{node}._target_` names an importable subclass of `kind` that takes `arguments`; added keys need a target."""
    if target is None:
        if arguments:
            raise ConfigError(
                f"+{node}.{next(iter(arguments))}: keys added to {node} are the arguments of your own class; set "
                f"{node}._target_=PACKAGE.CLASS, or remove the key"
            )
        return
    module_name, _, name = target.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(
            f"{node}._target_={target}: cannot import it ({error}); give PACKAGE.CLASS of an installed package or one "
            f"on PYTHONPATH"
        ) from None
    if not (isinstance(found, type) and issubclass(found, kind)):
        raise ConfigError(f"{node}._target_={target}: {found!r} is not a {kind.__name__} subclass")
    try:
        inspect.signature(found).bind(**arguments)
    except TypeError as error:
        raise ConfigError(f"{node}._target_={target}: {error}; pass its arguments as +{node}.NAME=VALUE") from None


def build_target(target: str, arguments: Mapping[str, Any]) -> Any:
    """An instance of `target` from `arguments` (a nested `_target_` among them built too; containers as plain ones)."""
    return instantiate({"_target_": target, **arguments}, _convert_="all")
