"""The MoRIIO drivers' harness: a prefill engine in a peer process (:mod:`.peer`) and ready-made 1P1D runs (:mod:`.cluster`)."""
