"""Adapters: kvfsm Trackers behind the connector interfaces of serving engines (vLLM)."""
