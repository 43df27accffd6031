"""The five parts of the demo, each a call into the library on embedded stand-ins, returning its figures.

Nothing here is new machinery: each part runs what the rest of kvfsm already
is (the static checks, the diagram generator, the scheduler simulator, the
Mooncake soak, the explorer) at a size that takes seconds, and wraps the
result in a :mod:`~kvfsm.showcase.demo.report` type that judges it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ...drivers.mooncake import EmbeddedMaster, StoreSender, connect_embedded
from ...explore import explore
from ...gen.diagram import to_mermaid, to_svg
from ...spec import SpecError, check, is_system_file, read
from ...spec.bundled import PD_ABORT
from ..bench.mooncake import SoakResult, soak
from ..prefix_sender import PreFixSender
from ..sim import SimConfig, Simulation, Workload
from .report import CheckPart, DiagramPart, Drawing, ExplorePart, MooncakePart, OffloadPart, SpecVerdict

FAULT_RATE = 0.10
"""Share of the Mooncake store calls that fail in the soak (raise, or answer negative codes)."""


@dataclass(frozen=True)
class Sizes:
    """How much each part runs: the default takes seconds per part on a 2-core machine, ``QUICK`` a fraction."""

    sim_requests: int
    soak_requests: int
    unfixed_seconds: float
    """How long the pre-fix sender runs before its leaks are counted (it stalls well before)."""
    explore_requests: int | None
    """Requests in the corrected composition; None: the bound its system file declares."""


FULL = Sizes(sim_requests=2000, soak_requests=5000, unfixed_seconds=1.0, explore_requests=None)
QUICK = Sizes(sim_requests=200, soak_requests=300, unfixed_seconds=0.5, explore_requests=3)


PRE_FIX_SUFFIX = "_pre_fix"
"""Spec files named ``*_pre_fix.yaml`` are a seed's pre-fix shape: the check must reject them."""


def spec_files(root: Path) -> list[Path]:
    """Every ``.yaml`` file under ``root`` (subfolders included), sorted; raises if there is none."""
    files = sorted(root.rglob("*.yaml"))
    if not files:
        raise FileNotFoundError(f"no .yaml spec files under {root}")
    return files


def _shown(path: Path, root: Path) -> str:
    return str(path.relative_to(root.parent))


def check_specs(root: Path) -> CheckPart:
    """`kvfsm check` on every spec under ``root``: machine specs and system files alike."""
    start = time.perf_counter()
    verdicts = []
    for path in spec_files(root):
        findings = check(path)
        errors = sum(f.severity == "error" for f in findings)
        verdicts.append(
            SpecVerdict(
                spec=_shown(path, root),
                kind="system" if is_system_file(path) else "machine",
                errors=errors,
                warnings=len(findings) - errors,
                codes=tuple(sorted({f.code for f in findings})),
                pre_fix=path.stem.endswith(PRE_FIX_SUFFIX),
            )
        )
    return CheckPart(tuple(verdicts), time.perf_counter() - start)


def draw_specs(root: Path, out: Path) -> DiagramPart:
    """Every machine spec under ``root`` as ``out/NAME.mmd`` and, where graphviz is installed, ``out/NAME.svg``.

    System files are not drawn: their roles are machine specs, drawn on their own.
    """
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    drawings: list[Drawing] = []
    skipped: str | None = None
    names: set[str] = set()
    for path in spec_files(root):
        if is_system_file(path):
            continue
        shown = _shown(path, root)
        name = path.stem if path.stem not in names else f"{path.parent.name}.{path.stem}"
        names.add(name)
        try:
            spec = read(path)
        except SpecError as exc:
            drawings.append(Drawing(shown, error=str(exc.findings[0])))
            continue
        mermaid = out / f"{name}.mmd"
        mermaid.write_text(to_mermaid(spec), encoding="utf-8")
        svg: Path | None = None
        if skipped is None:
            try:
                data = to_svg(spec)
            except OSError as exc:  # graphviz's dot is missing: the Mermaid text still says it all
                skipped = str(exc)
            else:
                svg = out / f"{name}.svg"
                svg.write_bytes(data)
        drawings.append(Drawing(shown, str(mermaid), str(svg) if svg else None))
    return DiagramPart(str(out), tuple(drawings), skipped, time.perf_counter() - start)


def offload_soak(seed: int, requests: int) -> OffloadPart:
    """Seed 003: the CPU-offload connector in the vLLM scheduler simulator, with eviction pressure,
    preemptions, client aborts while loads are in flight, and DMA and channel faults (the soak's defaults)."""
    start = time.perf_counter()
    sim = Simulation(Workload(num_requests=requests, seed=seed), SimConfig(check_every=5))
    report = sim.run()
    return OffloadPart(report, sim.offload.gpu_cache.device.type, time.perf_counter() - start)


def mooncake_soak(seed: int, requests: int, unfixed_seconds: float | None) -> MooncakePart:
    """Seed 000: the Mooncake store worker on the embedded store with :data:`FAULT_RATE` of its calls failing.

    With ``unfixed_seconds``, the pre-fix sender then runs the same workload
    and faults on a fresh store, until it stalls on what it leaked.
    """
    start = time.perf_counter()

    def run(sender: type[StoreSender], timeout: float) -> SoakResult:
        master = EmbeddedMaster()
        store = connect_embedded(master, global_segment_size=1 << 30)
        try:
            return soak(store, requests=requests, fault_rate=FAULT_RATE, seed=seed, timeout=timeout, sender=sender)
        finally:  # the master lives in a process-wide registry: drop it and the KV it holds
            store.close()
            master.stop()

    fixed = run(StoreSender, 120.0)
    unfixed = run(PreFixSender, unfixed_seconds) if unfixed_seconds is not None else None
    return MooncakePart(requests, fixed, unfixed, time.perf_counter() - start)


def explore_pd_abort(requests: int | None) -> ExplorePart:
    """Seed 002: explore the merged fix (the race remains) and the corrected protocol (``requests`` of them)."""
    start = time.perf_counter()
    merged = explore(PD_ABORT / "merged_fix.yaml")
    corrected = explore(PD_ABORT / "corrected.yaml", requests=requests)
    return ExplorePart(merged, corrected, time.perf_counter() - start)
