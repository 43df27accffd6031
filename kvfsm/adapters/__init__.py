"""Adapters: kvfsm Trackers behind the connector interfaces of serving engines (vLLM).

- :mod:`.vllm` / :mod:`.vllm_connector`: the CPU-offload connector;
- :mod:`.vllm_mooncake`: the Mooncake store connector;
- :mod:`.vllm_nixl`: the NIXL P/D connector, shaped like vLLM's ``NixlConnector``
  (``kv_connector_module_path="kvfsm.adapters.vllm_nixl"``).

They run drivers, so they need the ``kvfsm[torch]`` extra; importing one without it says so.
"""
