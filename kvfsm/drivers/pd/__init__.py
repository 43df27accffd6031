"""The PD abort protocol's drivers (``specs/pd_abort/``): decode's pages preallocated and freed, prefill's KV
written into them over the data plane (:class:`PageWriter`), chunk by chunk. The job that runs them in a prefill
and a decode process, with faults, is :mod:`kvfsm.harness.pd`.
"""

from .decode import DecodeDriver
from .pages import Pages
from .prefill import PrefillDriver
from .transport import EMBEDDED, PageWriter, embedded_writer

__all__ = ["EMBEDDED", "DecodeDriver", "PageWriter", "Pages", "PrefillDriver", "embedded_writer"]
