"""kvfsm watch for vLLM: a ``KVConnectorBase_V1`` that wraps any connector and watches its contract.

vLLM loads it like any connector, with the connector it wraps named in
``kv_connector_extra_config``::

    KVTransferConfig(
        kv_connector="WatchConnector",
        kv_connector_module_path="kvfsm.adapters.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={
            "inner": "OffloadingConnector",             # a name vLLM's registry knows, or a class in
            # "inner_module_path": "my.module",         # a module of yours (as kv_connector_module_path)
            "watch": {"send_timeout": 120, "journal": "/var/log/kvfsm"},
            # every other key is the inner connector's own extra config
        },
    )

The inner connector is built by vLLM's own ``KVConnectorFactory`` from a copy
of the config naming it, for both roles. Every call is delegated and returns
exactly what the inner connector returns; the WORKER role is delegation
only. On the SCHEDULER role the calls and their results feed a
:class:`~kvfsm.adapters.watch.Watch` (two Trackers on the contract's specs,
``specs/watch/``): ``get_num_new_matched_tokens`` and
``update_state_after_alloc`` begin and park a load, ``request_finished``
begins a hold when it returns ``delay_free=True``, ``update_connector_output``
(read *after* the inner connector ran, as vLLM acts on the output after it)
ends them with ``finished_sending``/``finished_recving`` and notes invalid
blocks, and ``build_connector_meta`` polls the deadlines once per step.

A watchdog that raises must never break the engine: every watch call is
guarded; an error is counted (:attr:`WatchConnector.watch_errors`) and logged
once, and the inner connector's result is returned as it was.

See docs/watch.md.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from .watch import LOGGER, Watch, WatchSettings

OWN_KEYS = ("inner", "inner_module_path", "watch")
"""The keys of ``kv_connector_extra_config`` the watch reads; every other key goes to the inner connector."""


def inner_transfer_config(kv_transfer_config: Any) -> Any:
    """The ``KVTransferConfig`` that names the inner connector, with the inner connector's own extra config."""
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    inner = extra.get("inner")
    if not isinstance(inner, str) or not inner:
        raise ValueError(
            "WatchConnector needs kv_connector_extra_config['inner']: the name of the connector it wraps "
            "(a name vLLM's registry knows, or a class in kv_connector_extra_config['inner_module_path'])"
        )
    if inner == "WatchConnector":
        raise ValueError("WatchConnector cannot wrap itself")
    module_path = extra.get("inner_module_path")
    return dataclasses.replace(
        kv_transfer_config,
        kv_connector=inner,
        kv_connector_module_path=module_path,
        kv_connector_extra_config={k: v for k, v in extra.items() if k not in OWN_KEYS},
    )


def inner_vllm_config(vllm_config: Any) -> Any:
    """A shallow copy of ``vllm_config`` whose ``kv_transfer_config`` names the inner connector."""
    inner = copy.copy(vllm_config)
    object.__setattr__(inner, "kv_transfer_config", inner_transfer_config(vllm_config.kv_transfer_config))
    return inner


class WatchConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Delegates every call to the inner connector; on the SCHEDULER role, watches the contract as it goes."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = inner_vllm_config(vllm_config)
        self._inner = KVConnectorFactory.create_connector(config, role, kv_cache_config)
        type(self)._inner_class = type(self._inner)
        self._inner_hma = isinstance(self._inner, SupportsHMA)
        for name in _DELEGATED:  # the inner connector's own bound methods: a delegated call costs no extra frame
            self.__dict__[name] = getattr(self._inner, name)
        self.watch: Watch | None = None
        self._tail_delay: set[str] = set()
        """Requests whose partial tail the inner connector keeps (``register_finished_partial_tail`` returned True)."""
        self.watch_errors = 0
        """Exceptions the watch raised and the connector swallowed (the first is logged)."""
        if role == KVConnectorRole.SCHEDULER:
            settings = WatchSettings.of(vllm_config.kv_transfer_config.kv_connector_extra_config.get("watch"))
            self.watch = Watch(settings, connector=type(self._inner).__name__)

    _inner_class: type[Any] | None = None
    """The class of the last inner connector built in this process (for the class-level hooks without a config)."""

    @property
    def inner(self) -> Any:
        """The wrapped connector."""
        return self._inner

    def _guarded(self, call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except Exception:
            self._failed()

    def _failed(self) -> None:
        """Count a failure of the watch (called from an ``except``); the first is logged with its traceback."""
        self.watch_errors += 1
        if self.watch_errors == 1:
            LOGGER.exception(
                "kvfsm watch [%s]: the watch failed; the connector is unaffected (later failures only counted)",
                type(self._inner).__name__,
            )

    def __getattr__(self, name: str) -> Any:
        """What the inner connector has beyond the base class (its stats, its halves) is read through."""
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    # -- the scheduler's calls that the watch reads (inline guards: these run per request) -------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        result = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        watch = self.watch
        if watch is not None:
            try:
                watch.matched(request.request_id, result[0], bool(result[1]))
            except Exception:
                self._failed()
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        result = self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        watch = self.watch
        if watch is not None:
            try:
                ids = blocks.get_block_ids() if num_external_tokens > 0 else ()
                watch.allocated(request.request_id, ids, num_external_tokens)
            except Exception:
                self._failed()
        return result

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        result = self._inner.build_connector_meta(scheduler_output)
        if self.watch is not None:
            self._guarded(self.watch.step)
        return result

    def update_connector_output(self, connector_output: Any) -> Any:
        result = self._inner.update_connector_output(connector_output)
        if self.watch is not None:  # after the inner connector: it may add reaped ids (MoRIIO), as vLLM then reads
            self._guarded(
                self.watch.output,
                connector_output.finished_sending,
                connector_output.finished_recving,
                connector_output.invalid_block_ids,
            )
        return result

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        result = self._inner.request_finished(request, block_ids)
        if self.watch is not None:
            self._finished(request.request_id, (block_ids,), result)
        return result

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> Any:
        # vLLM calls this one because the wrapper declares SupportsHMA; an inner connector without it gets the
        # call vLLM would have made on it (one group: the factory refused it with the hybrid manager on).
        if self._inner_hma:
            result = self._inner.request_finished_all_groups(request, block_ids)
        else:
            result = self._inner.request_finished(request, block_ids[0])
        if self.watch is not None:
            self._finished(request.request_id, block_ids, result)
        return result

    def register_finished_partial_tail(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        delay = self._inner.register_finished_partial_tail(request, *args, **kwargs)
        if delay and self.watch is not None:  # vLLM keeps the blocks for it as for delay_free (scheduler order)
            self._tail_delay.add(request.request_id)
        return delay

    def _finished(self, request_id: str, block_ids: Any, result: Any) -> None:
        try:
            tail = self._tail_delay
            kept = request_id in tail
            if kept:
                tail.discard(request_id)
            assert self.watch is not None
            self.watch.finished(request_id, block_ids, bool(result[0]) or kept)
        except Exception:
            self._failed()

    def shutdown(self) -> Any:
        try:
            return self._inner.shutdown()
        finally:
            if self.watch is not None:
                self._guarded(self._close)

    def _close(self) -> None:
        assert self.watch is not None
        summary = self.watch.close()
        LOGGER.info("kvfsm watch [%s]: %s", type(self._inner).__name__, summary)

    # -- the worker's abstract methods: pure delegation ------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._inner.wait_for_save()

    # -- class-level hooks vLLM calls with a config ---------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        inner = inner_vllm_config(vllm_config)
        layout: str | None = KVConnectorFactory.get_connector_class(
            inner.kv_transfer_config
        ).get_required_kvcache_layout(inner)
        return layout

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Mapping[str, Any]) -> bool:
        try:
            transfer = _Named(extra_config)
            inner = KVConnectorFactory.get_connector_class(inner_transfer_config(transfer))
        except (ValueError, AttributeError, ImportError):
            return False
        return bool(
            inner.requires_piecewise_for_cudagraph({k: v for k, v in extra_config.items() if k not in OWN_KEYS})
        )

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        inner = KVConnectorFactory.get_connector_class(inner_transfer_config(vllm_config.kv_transfer_config))
        cls._inner_class = inner
        inner_config = inner_vllm_config(vllm_config)
        return inner.build_prom_metrics(inner_config, *args, **kwargs)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        """The inner connector's stats class, once a connector (or its metrics) was built in this process."""
        inner = cls._inner_class
        return None if inner is None else inner.build_kv_connector_stats(data)


@dataclasses.dataclass
class _Named:
    """Just enough of a ``KVTransferConfig`` for :func:`inner_transfer_config` when vLLM hands over the extra config."""

    kv_connector_extra_config: Mapping[str, Any]


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: WatchConnector, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Delegated to the inner connector's ``{name}``."
    return method


def _delegate_property(name: str) -> property:
    return property(lambda self: getattr(self._inner, name), doc=f"The inner connector's ``{name}``.")


_DELEGATED: list[str] = ["start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"]
"""Methods bound to the inner connector's on each instance (the worker's per-layer calls among them)."""


def _wire_delegation() -> None:
    """Every other method and property of vLLM's base classes, delegated: a method vLLM adds is delegated too."""
    own = set(vars(WatchConnector))
    for base in (KVConnectorBase_V1, SupportsHMA):
        for name, value in vars(base).items():
            if name.startswith("__") or name in own or name == "role":
                continue
            if isinstance(value, property):
                setattr(WatchConnector, name, _delegate_property(name))
            elif callable(value) and not isinstance(value, classmethod | staticmethod | type):
                setattr(WatchConnector, name, _delegate(name))
                _DELEGATED.append(name)
            own.add(name)


_wire_delegation()
