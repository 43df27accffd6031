"""The checks every connector's ``kv_connector_extra_config`` parser shares, so a typo cannot go unnoticed."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any


def check_keys(extra: Mapping[str, Any], known: Collection[str], connector: str) -> None:
    """Refuse the keys ``connector`` does not read: a misspelt setting would otherwise keep its default unnoticed."""
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise ValueError(
            f"kv_connector_extra_config has {unknown}, which {connector} does not read; it reads {sorted(known)}"
        )


def seconds(extra: Mapping[str, Any], names: Iterable[str]) -> dict[str, float]:
    """The deadlines among ``names`` that ``extra`` gives, in seconds; the specs' defaults stand for the rest."""
    return {name: float(extra[name]) for name in names if name in extra}
