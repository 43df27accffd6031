"""Drivers: the side effects of specs on real systems (block pools, KV tensors, transfer engines)."""
