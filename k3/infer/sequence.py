"""Per-request state: tokens, sampling parameters, status and the cache bookkeeping the scheduler keeps.

A sequence's tokens are prompt + generated output. `num_computed` of them have their MLA latents in the
sequence's pages (`block_table`) and are folded into its KDA slot state (`slot`); the scheduler feeds the
rest. `block_hashes[i]` is the chain hash of tokens [0, (i+1)*unit) once they are all computed.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 = greedy; top_k 0 / top_p 1 = off."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0 = only the chosen token's)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # reserved ids detokenized as these strings instead of their names (K3Tokenizer.decode's
    # reserved_text): the chat API marks its markers so that text spelling one stays text
    reserved_text: tuple[tuple[int, str], ...] = ()

    def __post_init__(self):
        checks = {
            "max_tokens": self.max_tokens >= 0,
            "temperature": 0 <= self.temperature < float("inf"),
            "top_k": self.top_k >= 0,
            "top_p": 0 < self.top_p <= 1,
            "seed": self.seed is None or 0 <= self.seed < 2**63,
            "logprobs": self.logprobs is None or 0 <= self.logprobs <= 20,
            "prompt_logprobs": self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} out of range: {getattr(self, name)!r}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass
class Sequence:
    """One request. `salt` (the tenant, e.g. the API key) seeds its prefix-cache hash chain."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    salt: str = ""
    request_id: str = ""
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)  # MLA page ids
    slot: int | None = None  # KDA state slot
    block_hashes: list[int] = field(default_factory=list)
    pending_snapshot: tuple[int, object] | None = None  # (length, handle) taken during decode
    capture: int = 0  # this step's chunk also snapshots the KDA state at this position (0: none)
    captured: tuple[int, object] | None = None  # (length, handle) the runner captured, for the engine
    finish_reason: str | None = None
    error: str | None = None  # why this request alone failed (finish_reason "error"), e.g. its sampling
    text: str = ""  # detokenized output (when the engine has a tokenizer), cut at a stop string
    # incremental detokenizing: output[:stable_ids] decodes to exactly stable_text (ends on a whole
    # character), so each step decodes only the tokens after it
    stable_ids: int = 0
    stable_text: str = ""
    stop_checked: int = 0  # text[:stop_checked] is final and holds no stop string (searched once)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    junction: int = 0  # where the cached MLA chain outruns the snapshots: a chunk ends there
    generator: object = None  # torch.Generator for seeded sampling (set by the engine)
    logprobs: list = field(default_factory=list)  # per output token: (logprob, [(id, logprob), ...])
    prompt_logprobs: list = field(default_factory=list)  # per prompt token from the second on
    arrival: int = field(default_factory=lambda: next(_ids))
    media: tuple = ()  # k3.infer.media.MediaSpan: prompt positions whose embeddings are given (images)

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("prompt must contain at least one token")
        if not self.request_id:
            self.request_id = f"req-{self.arrival}"

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_uncomputed(self) -> int:
        return len(self) - self.num_computed
