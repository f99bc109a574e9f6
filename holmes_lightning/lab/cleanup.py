"""`python -m holmes_lightning.lab.cleanup [--all]`: remove the lab namespaces of runs that died (e.g. SIGKILL)."""

from __future__ import annotations

import argparse
import os

from holmes_lightning.lab.design import NAMESPACE_PATTERN
from holmes_lightning.lab.network import NETNS_ETC, list_namespaces, remove_namespaces, unavailable_reason


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers(include_live: bool = False) -> list[str]:
    """Lab namespaces (and /etc/netns folders) whose run's process is gone; with `include_live`, every lab one."""
    names = set(list_namespaces()) | {p.name for p in NETNS_ETC.glob("holmes-*")}
    matches = [(name, NAMESPACE_PATTERN.match(name)) for name in names]
    found = [name for name, m in matches if m and (include_live or not _alive(int(m.group(1))))]
    return sorted(found, key=lambda name: name.endswith("-br"))  # nodes first, bridges last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--all", action="store_true", help="also remove namespaces of lab runs still alive")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"holmes lab cleanup: nothing to do here ({reason})")
        return 0
    names = leftovers(include_live=args.all)
    remove_namespaces(names)
    print(f"holmes lab cleanup: removed {len(names)} namespaces" + (f": {' '.join(names)}" if names else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
