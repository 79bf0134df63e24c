"""Engine configuration (frozen dataclass, checked in __post_init__)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Memory is sized up front: `num_pages` MLA pages of `page_size` tokens (shared by all MLA layers'
    pools) and `max_num_seqs` KDA state slots. One step feeds at most `max_num_batched_tokens` prompt
    tokens (its decode rows ride outside that budget), a prefill chunk at most `max_prefill_chunk`. The
    prefix cache matches in units of `prefix_unit` tokens and keeps KDA snapshots within
    `snapshot_budget_bytes`, at most `snapshots_per_path` on one conversation's chain.
    `capture_snapshots`: the KDA state at the last aligned position before a prompt's final token is
    captured inside the prompt's last chunk (k3.model.state.KDAState.capture_at) instead of ending a chunk
    there, which costs a second, short forward per prompt. `compile` compiles the batch-1 decode step into
    one graph (k3.infer.decode.torch_step) and fuses the SiTU activations of prefill
    (k3.ops.glu.fused_activations): a C++ compiler at run time, tens of seconds once. `native` runs
    one-token rows (decode) through the whole-model C step where the model qualifies
    (k3.infer.decode.native_step: fp32 on the CPU, the release's K3 config); `compile` then only matters where
    it does not. `keep_freed_memory` keeps freed activations in the process's C heap for the next forward
    instead of faulting them in again (k3.infer.memory; process-wide, glibc only)."""

    page_size: int = 64
    num_pages: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 1024
    max_model_len: int = 8192
    enable_prefix_cache: bool = True
    prefix_unit: int = 64
    snapshot_budget_bytes: int = 1 << 30
    snapshots_per_path: int = 4
    capture_snapshots: bool = True  # snapshot inside the last prompt chunk, not by pausing there
    compile: bool = False  # torch.compile the batch-1 decode step and the prefill activations
    native: bool = True  # decode rows through the C step (k3.infer.decode.native_step) where it qualifies
    keep_freed_memory: bool = True  # glibc keeps freed activations for reuse (k3.infer.memory)

    def __post_init__(self):
        for name in (
            "page_size",
            "num_pages",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_prefill_chunk",
            "max_model_len",
            "prefix_unit",
            "snapshots_per_path",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.page_size % self.prefix_unit:
            raise ValueError(
                f"page_size ({self.page_size}) must be a multiple of prefix_unit ({self.prefix_unit})"
            )
        if self.max_model_len > self.num_pages * self.page_size:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the page pool "
                f"({self.num_pages} x {self.page_size} tokens)"
            )
        if self.snapshot_budget_bytes < 0:
            raise ValueError(f"snapshot_budget_bytes must be >= 0, got {self.snapshot_budget_bytes}")
