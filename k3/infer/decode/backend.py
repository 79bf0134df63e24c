"""The engine's decode backend, chosen once when the engine is built and logged.

`DecodeStep` runs one-token rows through the native C step (k3.infer.decode.native_step) where
`EngineConfig.native` is on and the model qualifies, batches of more than its `max_rows` rows and every
other model through the torch step (k3.infer.decode.torch_step, compiled at batch 1 with
`EngineConfig.compile`). The choice and, where the native step declines, its reason go to the
`k3.infer` logger at INFO.
"""

from __future__ import annotations

import logging

from k3.infer.decode.native_step import NativeDecodeStep, unsupported
from k3.infer.decode.torch_step import TorchDecodeStep

log = logging.getLogger("k3.infer")


class DecodeStep:
    """One-token rows of the `runner`'s pools (k3.infer.model_runner.ModelRunner) -> logits [B, 1, V]."""

    def __init__(self, runner, compile: bool = False, native: bool = False):
        self.torch = TorchDecodeStep(runner, compile=compile)
        self.native: NativeDecodeStep | None = None
        why = "EngineConfig.native is off"
        if native:
            why = unsupported(runner)
            self.native = NativeDecodeStep.build(runner) if why is None else None
            if why is None and self.native is None:
                why = "the C step did not build (see the warning)"
        self.why_not_native = None if self.native is not None else why
        torch_name = "torch, compiled at batch 1" if compile else "torch, eager"
        if self.native is not None:
            self.backend = f"native C step (up to {self.native.max_rows} rows; {torch_name} beyond)"
        else:
            self.backend = f"{torch_name} ({why})"
        log.info("decode backend: %s", self.backend)

    def __call__(self, ids: list[int], slots: list[int], tables: list[list[int]], lengths: list[int]):
        """Python rows (token, slot, page list, cached length) -> logits [B, 1, V] fp32."""
        if self.native is not None and len(ids) <= self.native.max_rows:
            return self.native(ids, slots, tables, lengths)
        return self.torch(ids, slots, tables, lengths)
