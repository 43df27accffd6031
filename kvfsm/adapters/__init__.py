"""Adapters: kvfsm Trackers behind the connector interfaces of serving engines (vLLM).

They run drivers, so they need the ``kvfsm[torch]`` extra; importing one without it says so.
"""
