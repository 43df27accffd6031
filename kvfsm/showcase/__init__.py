"""Not the library: what demonstrates and measures it.

The demo (``kvfsm demo``), the benchmarks (``kvfsm bench``), a model of
vLLM's scheduler that drives the CPU-offload connector, and drivers set up for
model-based tests or shaped like known bugs. Nothing in the core imports this
package; it needs the ``kvfsm[torch]`` / ``kvfsm[mooncake]`` extras.
"""
