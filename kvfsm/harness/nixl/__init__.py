"""The NIXL drivers' harness: prefill ranks with real NIXL agents in a peer process (:mod:`.peer`)."""
