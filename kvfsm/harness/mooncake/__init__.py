"""The Mooncake store driver's harness: faults injected in front of any store (:mod:`.faults`), and a real
``mooncake_master`` started on loopback and stopped by pid (:mod:`.master`)."""

from .faults import STORE_FAULTS, Fault, FaultyStore, InjectedStoreFault, raising, returning, store_plan
from .master import MasterProcess

__all__ = [
    "STORE_FAULTS",
    "Fault",
    "FaultyStore",
    "InjectedStoreFault",
    "MasterProcess",
    "raising",
    "returning",
    "store_plan",
]
