"""The torch decode step: B rows feeding one token each, as one function of tensors.

    logits [B, 1, V] fp32 = step(ids [B, 1], slots [B], block_tables [B, P], lengths [B])

It gathers each KDA layer's conv and recurrent states from the slot pools, runs the decoder with the
engine's paged MLA decode state (`k3.infer.cache.paged_mla.PagedDecodeMLAState`: the new latents go into
the pages and the attention reads them inside one opaque op), applies the final norm and the head, and
writes the KDA states back into their slots. Every shape is fixed by B and P = ceil(max_model_len /
page_size): the block tables are padded to P columns, and the only thing that grows from step to step --
the number of keys a row attends over -- stays inside the paged op. It is the reference of the native
step (k3.infer.decode.native_step), and the backend wherever that one does not run.

That is what lets `torch.compile` trace the whole step as one graph (`compile=True`): at batch 1 the
eager step spends most of its time in ~1,800 small op dispatches (k3-tiny), which the compiled graph
fuses into a few dozen C++ loops around the weight mat-muls. Only batch-1 steps are compiled (one graph,
one compile); batches of several rows amortise the dispatches over their rows and run eagerly, as does
everything when compiling fails (for instance without a C++ compiler), with a warning. Compiled and
eager steps compute the same maths; the fused loops may round differently (tests compare them).
"""

from __future__ import annotations

import time
import warnings

import torch

from k3.infer.cache.paged_mla import PagedDecodeMLAState

# Inductor turns one-row mat-muls (every projection of a batch-1 step) into fused multiply-reduce loops
# that stream the weight once; on a CPU these run faster than the BLAS gemv calls they replace (k3-tiny,
# 1 thread: 6.2 vs 9.8 ms per token, docs/engine.md) and fuse with their neighbours.
INDUCTOR_OPTIONS = {"post_grad_fusion_options": {"decompose_mm_pass": {}}}


def block_table_width(config) -> int:
    """P: the block-table columns of a decode step, ceil(max_model_len / page_size) (EngineConfig)."""
    return -(-config.max_model_len // config.page_size)


class TorchDecodeStep:
    """Runs one-token rows of the `runner`'s pools (k3.infer.model_runner.ModelRunner) in torch."""

    def __init__(self, runner, compile: bool = False):
        self.runner, self.compile = runner, compile
        self.pages = block_table_width(runner.config)  # P
        self._compiled = None
        self.compile_seconds: float | None = None

    def __call__(self, ids: list[int], slots: list[int], tables: list[list[int]], lengths: list[int]):
        """Python rows (token, slot, page list, cached length) -> logits [B, 1, V] fp32."""
        args = self.tensors(ids, slots, tables, lengths)
        if self.compile and len(ids) == 1:
            out = self._run_compiled(args)
            if out is not None:
                return out
        return self.step(*args)

    def tensors(self, ids: list[int], slots: list[int], tables: list[list[int]], lengths: list[int]):
        """`step`'s arguments from Python rows: ids [B, 1], slots [B], block tables [B, P] (padded), lengths
        [B], on the pools' device."""
        dev = self.runner.device
        padded = [t[: self.pages] + [0] * (self.pages - len(t[: self.pages])) for t in tables]
        return (
            torch.tensor(ids, device=dev).view(-1, 1),
            torch.tensor(slots, device=dev),
            torch.tensor(padded, dtype=torch.long, device=dev),
            torch.tensor(lengths, dtype=torch.long, device=dev),
        )

    def step(self, ids, slots, block_tables, lengths) -> torch.Tensor:
        """The eager step (module docstring); tensors on the pools' device."""
        r = self.runner
        model, ps = r.model, r.config.page_size
        state = [
            r.kda_state(i, slots) if i in r.kda else PagedDecodeMLAState(r.mla[i], block_tables, lengths, ps)
            for i in range(model.config.num_hidden_layers)
        ]
        h = model.model(input_ids=ids, state=state)
        logits = model.lm_head(model.model.norm(h)).float()
        r.store_kda(state, slots)
        return logits

    def _run_compiled(self, args) -> torch.Tensor | None:
        """The compiled step (compiled on first use, timed in `compile_seconds`); None after a failure
        to compile, which is reported once and leaves the engine eager. Compiler errors are raised while
        tracing and generating code, before the graph runs, so nothing was written to the pools."""
        if self._compiled is None:
            fn = torch.compile(self.step, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
            t0 = time.perf_counter()
            try:
                out = fn(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure falls back to eager
                warnings.warn(
                    f"compiled decode disabled, running eagerly: {type(e).__name__}: {e}", stacklevel=3
                )
                self._compiled = self.compile = False
                return None
            self.compile_seconds, self._compiled = time.perf_counter() - t0, fn
            return out
        return self._compiled(*args) if self._compiled else None
