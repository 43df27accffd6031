"""The demo: what kvfsm does for a KV connector, shown on the bundled specs and embedded stand-ins in seconds.

``run(Options())`` checks and draws every bundled spec, then replays three
seed reports: the CPU-offload connector in the vLLM scheduler simulator (seed
003), the Mooncake store worker under injected faults (seed 000, next to the
pre-fix sender, which leaks) and the PD abort compositions in the explorer
(seed 002). It returns a :class:`DemoReport` whose ``ok`` says whether every
part came out as kvfsm promises. Nothing needs to be started: no
``mooncake_master``, no GPU (CUDA is used when present). ``kvfsm demo``
renders it; docs/demo.md explains each part.
"""

from ...spec.bundled import SPECS
from .parts import FULL, QUICK, Sizes
from .report import (
    CheckPart,
    DemoReport,
    DiagramPart,
    Drawing,
    ExplorePart,
    FailedPart,
    MooncakePart,
    OffloadPart,
    PartResult,
    SpecVerdict,
)
from .run import NAMES, PARTS, Options, Part, Progress, run

__all__ = [
    "FULL",
    "NAMES",
    "PARTS",
    "QUICK",
    "SPECS",
    "CheckPart",
    "DemoReport",
    "DiagramPart",
    "Drawing",
    "ExplorePart",
    "FailedPart",
    "MooncakePart",
    "OffloadPart",
    "Options",
    "Part",
    "PartResult",
    "Progress",
    "Sizes",
    "SpecVerdict",
    "run",
]
