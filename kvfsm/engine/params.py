"""Where each param's value comes from: the Tracker's ``params``, the environment, or the spec — said once.

A deadline that silently took a default is a classic of connector bugs
(vLLM #51301); here every param resolves in a fixed order and the tracker
logs, once per process and machine, each value and its source.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import NamedTuple

from ..errors import BindingError
from ..spec.model import Spec

LOGGER = logging.getLogger("kvfsm.params")

_logged: set[tuple[str, tuple[tuple[str, float, str], ...]]] = set()


class Resolved(NamedTuple):
    """A param's value and where it came from: ``Tracker(params=)``, ``environment KVFSM_...`` or ``spec``."""

    value: float
    source: str


def env_name(machine: str, param: str) -> str:
    """The environment variable that sets ``param`` of ``machine``: ``KVFSM_<MACHINE>_<PARAM>``, upper case."""
    return re.sub(r"[^A-Z0-9]", "_", f"KVFSM_{machine}_{param}".upper())


def resolve(spec: Spec, overrides: Mapping[str, float], environ: Mapping[str, str] = os.environ) -> dict[str, Resolved]:
    """Every declared param's value: ``overrides`` first, then the environment, then the spec."""
    problems = spec.param_problems(overrides)
    if problems:
        raise BindingError("; ".join(problems))
    out: dict[str, Resolved] = {}
    for name, default in spec.params.items():
        variable = env_name(spec.name, name)
        if name in overrides:
            out[name] = Resolved(float(overrides[name]), "Tracker(params=...)")
        elif variable in environ:
            text = environ[variable]
            problems = spec.param_problems({name: _number(text)})
            if problems:
                raise BindingError(f"environment {variable}={text!r}: {problems[0]}")
            out[name] = Resolved(float(_number(text)), f"environment {variable}")
        else:
            out[name] = Resolved(float(default), "spec")
    return out


def log_once(spec: Spec, resolved: Mapping[str, Resolved]) -> None:
    """Log the resolved params of ``spec`` the first time this process sees them."""
    signature = (spec.name, tuple((n, r.value, r.source) for n, r in sorted(resolved.items())))
    if not resolved or signature in _logged:
        return
    _logged.add(signature)
    LOGGER.info("%s params: %s", spec.name, ", ".join(f"{n} = {r.value:g} ({r.source})" for n, r in resolved.items()))


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text
