"""Adapters: kvfsm Trackers behind the connector interfaces of serving engines (vLLM).

- :mod:`.vllm`: the module path vLLM is given (``kv_connector_module_path="kvfsm.adapters.vllm"``); it loads
  each kvfsm connector class when vLLM asks for it, and imports neither vLLM nor torch;
- :mod:`.vllm_cpu_offload` / :mod:`.vllm_connector`: the CPU-offload connector (its two halves, and the two as one
  ``KVConnectorBase_V1``);
- :mod:`.vllm_mooncake`: the Mooncake store connector;
- :mod:`.vllm_nixl`: the NIXL P/D connector, shaped like vLLM's ``NixlConnector``
  (``kv_connector_module_path="kvfsm.adapters.vllm_nixl"``);
- :mod:`.vllm_moriio`: the MoRIIO P/D connector (WRITE mode), and :mod:`.vllm_moriio_pd` its plug for the P/D runner.

What they share is written once: :mod:`.vllm_kv_cache` (vLLM's KV cache, adopted), :mod:`.vllm_settings` (the
checks of ``kv_connector_extra_config``), :mod:`.vllm_async` (whole-request transfers between steps) and
:mod:`.vllm_pd` (a P/D worker's prefill and decode ranks).

The connectors run drivers, so they need the ``kvfsm[torch]`` extra; importing one without it says so.
"""
