"""Not the library: what demonstrates and measures it.

The demo (``kvfsm demo``), the benchmarks (``kvfsm bench``), a model of
vLLM's scheduler that drives the CPU-offload connector, and drivers set up for
model-based tests or shaped like known bugs. Nothing in the core imports this
package. It needs the ``kvfsm[showcase]`` extra (torch for the drivers it runs,
and the general state-machine libraries the benchmark compares against), and
says so on import when one is missing.
"""

from importlib.util import find_spec

_NEEDS = ("torch", "transitions", "statemachine")
"""The modules the ``showcase`` extra installs (``statemachine`` is python-statemachine)."""

_missing = [module for module in _NEEDS if find_spec(module) is None]
if _missing:
    raise ImportError(f"kvfsm.showcase needs {', '.join(_missing)}: pip install 'kvfsm[showcase]'", name=_missing[0])
