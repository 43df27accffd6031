"""What runs the drivers for tests, demos and benchmarks, and is no driver itself: peer processes and ready-made runs.

- :class:`PeerProcess` / :class:`PeerError` (:mod:`.peer`): a Python module in
  a subprocess of its own, talked to in JSON lines with a deadline on every
  answer, paused, resumed, stopped and killed by pid; :func:`~.peer.say` and
  :func:`~.peer.serve` are the peer's half;
- :class:`FaultPlan` / :class:`FaultyAgent` (:mod:`.faults`): one fault plan,
  and one fault wrapper over the data plane, for every transfer driver;
- :func:`~.load.closed_loop` (:mod:`.load`): the closed loop the MoRIIO and
  NIXL soaks and demos run;
- :mod:`.moriio`: a MoRIIO prefill engine on the real Mooncake TransferEngine
  in a peer process, MoRIIO's load on the closed loop, and the ready-made 1P1D
  runs (embedded, Mooncake, NIXL);
- :mod:`.nixl`: NIXL prefill ranks with real agents in a peer process, and a
  decode rank's agent behind faults;
- :mod:`.mooncake`: faults in front of a Mooncake store, and a real
  ``mooncake_master`` on loopback;
- :mod:`.pd`: the P/D job (processes started, faults injected, the prefill
  killed and restarted, the ledger).

The harness imports the drivers; no driver imports the harness.
"""

from .faults import FaultPlan, FaultyAgent
from .peer import PeerError, PeerProcess

__all__ = ["FaultPlan", "FaultyAgent", "PeerError", "PeerProcess"]
