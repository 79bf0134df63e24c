"""The engine's configuration: a frozen dataclass, every field checked on construction."""

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Memory is sized up front: pages of MLA latents shared by all MLA layers' pools, and KDA state slots."""

    page_size: int = 64  # tokens per MLA page
    num_pages: int = 512  # MLA pages (each layer's pool holds num_pages * page_size latent rows)
    max_num_seqs: int = 32  # KDA state slots: sequences running at once
    max_num_batched_tokens: int = 2048  # prompt tokens one step feeds (its decode rows ride outside it)
    max_prefill_chunk: int = 1024  # tokens of one prefill chunk
    max_model_len: int = 8192
    enable_prefix_cache: bool = True
    prefix_unit: int = 64  # the prefix cache matches in units of this many tokens
    snapshot_budget_bytes: int = 1 << 30  # KDA snapshots the prefix cache keeps
    snapshots_per_path: int = 4  # at most this many snapshots on one conversation's chain
    # the KDA state at the last aligned position before a prompt's final token is captured inside the
    # prompt's last chunk (k3.model.state.KDAState.capture_at) instead of ending a chunk there, which
    # costs a second, short forward per prompt
    capture_snapshots: bool = True
    # torch.compile the batch-1 decode step into one graph (k3.infer.decode.torch_step) and fuse the SiTU
    # activations of prefill (k3.ops.glu.fused_activations): a C++ compiler at run time, tens of seconds
    # once; it matters only where the native step does not run
    compile: bool = False
    # one-token rows through the whole-model C step (k3.infer.decode.native_step) where the model
    # qualifies: fp32 on the CPU, the release's K3 config
    native: bool = True
    # prompt tokens through the native step too, each as a row that sees the rows before it: a request's
    # tokens and logprobs are then the same bits whatever its chunking, batch mates, prefix-cache hits
    # and thread count, and a prompt's last logits equal decode's (k3.infer.model_runner); needs `native`
    # and costs prefill speed (docs/serving.md#deterministic-serving)
    deterministic: bool = False
    # glibc keeps freed activations in the C heap for the next forward instead of faulting them in again
    # (k3.infer.memory; process-wide, glibc only)
    keep_freed_memory: bool = True

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
