"""The simulated requests: prompts with shared prefixes, arrivals, and vLLM's per-request fields.

Tokens and outputs are deterministic functions of the seed and the request,
so a preempted request recomputes exactly the tokens it had (greedy
decoding), and block hashes chain like vLLM's: a block's hash names its
tokens and every token before them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from ...adapters.vllm_api import RequestStatus

VOCAB = 32_000


@dataclass(frozen=True)
class Workload:
    """What arrives: how many requests, how fast, how long, how much they share, how often clients give up."""

    num_requests: int = 1000
    arrival_rate: float = 0.4
    """Mean new requests per scheduler step (Poisson)."""
    num_prefixes: int = 8
    """Distinct shared prefixes (system prompts, documents)."""
    prefix_len: tuple[int, int] = (32, 160)
    share_prob: float = 0.8
    """Chance that a request starts with one of the shared prefixes."""
    unique_len: tuple[int, int] = (8, 64)
    """Tokens after the prefix, different for every request."""
    output_len: tuple[int, int] = (8, 96)
    abort_rate: float = 0.0003
    """Chance per step that the client of any live request aborts it."""
    abort_loading_rate: float = 0.05
    """Extra chance per step that the client of a request whose load is in flight aborts it (a slow load)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefix_len", "unique_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"Workload.{name} must be (low, high) with 0 < low <= high, not {(lo, hi)}")
        if self.arrival_rate <= 0 or self.num_requests < 0:
            raise ValueError("Workload needs arrival_rate > 0 and num_requests >= 0")


@dataclass(eq=False)
class SimRequest:
    """A request with the fields vLLM's connector API reads (satisfies ``vllm_api.Request``)."""

    request_id: str
    index: int
    prompt: list[int]
    max_output: int
    block_size: int
    status: RequestStatus = RequestStatus.WAITING
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    """The scheduler's GPU blocks for this request (one reference each)."""
    num_preemptions: int = 0
    load: tuple[int, int] | None = None
    """(first block, blocks) of the async load vLLM waits for, to check its bytes when it is over."""

    def __post_init__(self) -> None:
        self._hash_blocks()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token(self, position: int) -> int:
        n = len(self.prompt)
        return self.prompt[position] if position < n else self.output[position - n]

    def append_output(self) -> None:
        """Sample the next token: a fixed function of the request and position (greedy decoding)."""
        position = self.num_tokens
        self.output.append((self.index * 1_000_003 + position * 7_919) % VOCAB)
        self._hash_blocks()

    def _hash_blocks(self) -> None:
        bs = self.block_size
        parent = self.block_hashes[-1] if self.block_hashes else 0
        for b in range(len(self.block_hashes), self.num_tokens // bs):
            parent = hash((parent, tuple(self.token(i) for i in range(b * bs, (b + 1) * bs))))
            self.block_hashes.append(parent)

    def get_block_ids(self) -> tuple[list[int], ...]:
        """The request's blocks as vLLM's ``KVCacheBlocks`` gives them: one list per group."""
        return (self.blocks,)


def poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's method; ``mean`` is small here)."""
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def make_requests(workload: Workload, block_size: int, rng: random.Random) -> list[SimRequest]:
    """All requests of ``workload``, in arrival order."""
    prefixes = [
        [rng.randrange(VOCAB) for _ in range(rng.randint(*workload.prefix_len))] for _ in range(workload.num_prefixes)
    ]
    out = []
    for i in range(workload.num_requests):
        prompt = list(rng.choice(prefixes)) if prefixes and rng.random() < workload.share_prob else []
        prompt += [rng.randrange(VOCAB) for _ in range(rng.randint(*workload.unique_len))]
        out.append(SimRequest(f"req-{i}", i, prompt, rng.randint(*workload.output_len), block_size))
    return out
