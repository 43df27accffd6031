"""Drivers: the side effects of specs on real systems (block pools, KV tensors, transfer engines).

Every driver moves KV blocks held in torch tensors, so the package checks for
torch once, here, before any driver module is imported: without it, importing
any of them says which extra to install instead of failing deep inside.
"""

from importlib.util import find_spec

if find_spec("torch") is None:
    raise ImportError("kvfsm.drivers needs torch: pip install 'kvfsm[torch]'", name="torch")
