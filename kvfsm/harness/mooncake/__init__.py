"""The Mooncake store driver's harness: faults injected in front of any store (:mod:`.faults`), and a real
``mooncake_master`` started on loopback and stopped by pid (:mod:`.master`)."""

from .faults import Fault, FaultyStore, InjectedStoreFault, raising, returning
from .master import MasterProcess

__all__ = ["Fault", "FaultyStore", "InjectedStoreFault", "MasterProcess", "raising", "returning"]
