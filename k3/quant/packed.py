"""Inference with MXFP4 routed experts kept packed in memory (docs/spec.md#mxfp4).

`PackedRoutedExperts` replaces a `RoutedExperts` for serving. It holds each stacked expert weight as the
release stores it, uint8 codes (two FP4 nibbles per byte) and uint8 E8M0 scales (one per 32 weights along
the input dim), i.e. 4.25 bits per weight instead of 16 for BF16:

    w1 (gate), w3 (up): weight_packed [E, I, Dl/2], weight_scale [E, I, Dl/32]
    w2 (down):          weight_packed [E, Dl, I/2], weight_scale [E, Dl, I/32]

Its state_dict keys are `experts.w1.weight_packed` / `.weight_scale` etc., the release's per-expert
names `experts.{e}.w1.weight_packed` stacked over e. Each call dequantizes, one expert at a time, only
the experts that received tokens, to the compute dtype of `z` (exact for BF16 and FP32: an FP4 value times
a power of two always fits), so the result equals RoutedExperts holding the dequantized weights.

`pack_model_experts(model)` swaps them into a model, quantizing its high-precision experts;
`k3.quant.checkpoint.load_mxfp4_checkpoint(dir, packed=True)` fills them straight from an MXFP4
checkpoint without ever building the experts in high precision.
"""

import torch
from torch import nn

from k3.model.moe import RoutedExperts
from k3.ops.glu import GLUFn
from k3.ops.moe import EXPERT_IMPLS, expert_mlp, experts_reference
from k3.ops.mx import BLOCK_SIZE, dequantize_mx, quantize_mx

FMT = "mxfp4"


class PackedWeight(nn.Module):
    """One stacked MXFP4 weight: weight_packed uint8 [E, out, in/2], weight_scale uint8 [E, out, in/32]."""

    def __init__(self, weight_packed: torch.Tensor, weight_scale: torch.Tensor):
        super().__init__()
        if weight_packed.dtype != torch.uint8 or weight_scale.dtype != torch.uint8:
            raise ValueError(
                f"weight_packed / weight_scale must be uint8, got {weight_packed.dtype} / "
                f"{weight_scale.dtype}"
            )
        E, out, half = weight_packed.shape
        if tuple(weight_scale.shape) != (E, out, 2 * half // BLOCK_SIZE) or (2 * half) % BLOCK_SIZE:
            raise ValueError(
                f"weight_packed {list(weight_packed.shape)} and weight_scale {list(weight_scale.shape)} "
                f"do not form an MXFP4 weight (expected weight_scale [{E}, {out}, {2 * half // BLOCK_SIZE}])"
            )
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("weight_scale", weight_scale)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "PackedWeight":
        """From a high-precision stacked weight [E, out, in], one expert at a time (bounded fp32 scratch)."""
        codes, scales = zip(*(quantize_mx(w_e.detach(), FMT) for w_e in w.unbind(0)), strict=True)
        return cls(torch.stack(codes), torch.stack(scales))

    @classmethod
    def empty(cls, shape: tuple[int, int, int], device: torch.device | str = "meta") -> "PackedWeight":
        """Uninitialized buffers for a logical [E, out, in] weight (to be filled by load_state_dict)."""
        E, out, inp = shape
        packed = torch.empty(E, out, inp // 2, dtype=torch.uint8, device=device)
        return cls(packed, torch.empty(E, out, inp // BLOCK_SIZE, dtype=torch.uint8, device=device))

    @property
    def shape(self) -> torch.Size:
        """The logical (dequantized) shape [E, out, in]."""
        E, out, half = self.weight_packed.shape
        return torch.Size((E, out, 2 * half))

    def dequantize(self, e: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert e's weight [out, in] (or all of them, [E, out, in]) in `dtype`."""
        if e is None:
            return dequantize_mx(self.weight_packed, self.weight_scale, FMT, dtype)
        return dequantize_mx(self.weight_packed[e], self.weight_scale[e], FMT, dtype)

    def extra_repr(self) -> str:
        return f"mxfp4 {list(self.shape)}"


class PackedRoutedExperts(nn.Module):
    """Routed experts with MXFP4-packed w1/w2/w3; same forward as RoutedExperts.

    forward(z [T, Dl], weights [T, k], indices [T, k], impl=None) -> u [T, Dl] = Σ_i p_i E_i(z).
    impl "grouped" (default) dequantizes per expert, only those with tokens; "reference" dequantizes every
    expert and runs `experts_reference`.
    """

    def __init__(
        self, w1: PackedWeight, w2: PackedWeight, w3: PackedWeight, act: GLUFn, impl: str = "grouped"
    ):
        super().__init__()
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"impl must be one of {tuple(EXPERT_IMPLS)}, got {impl!r}")
        E, I, Dl = w1.shape
        if w3.shape != w1.shape or w2.shape != (E, Dl, I):
            raise ValueError(
                f"expected w1, w3 [E, I, Dl] and w2 [E, Dl, I]; got {list(w1.shape)}, {list(w3.shape)}, "
                f"{list(w2.shape)}"
            )
        self.w1, self.w2, self.w3, self.act, self.impl = w1, w2, w3, act, impl

    @classmethod
    def from_experts(cls, experts: RoutedExperts) -> "PackedRoutedExperts":
        """Quantize a RoutedExperts' weights (if on meta: empty buffers of the right shapes)."""
        if experts.w1.is_meta:
            w1, w2, w3 = (PackedWeight.empty(tuple(w.shape)) for w in (experts.w1, experts.w2, experts.w3))
        else:
            w1, w2, w3 = (PackedWeight.quantize(w) for w in (experts.w1, experts.w2, experts.w3))
        return cls(w1, w2, w3, experts.act, experts.impl)

    def forward(
        self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, impl: str | None = None
    ) -> torch.Tensor:
        impl = impl or self.impl
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"impl must be one of {tuple(EXPERT_IMPLS)}, got {impl!r}")
        if impl == "reference":
            w1, w2, w3 = (w.dequantize(dtype=z.dtype) for w in (self.w1, self.w2, self.w3))
            return experts_reference(z, weights, indices, w1, w2, w3, self.act)
        return self._grouped(z, weights, indices)

    def _grouped(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """`experts_grouped` with each used expert's weights dequantized just before its GEMMs."""
        E, I, Dl = self.w1.shape
        T = z.shape[0]
        if z.dim() != 2 or z.shape[1] != Dl or weights.shape != indices.shape or indices.shape[0] != T:
            raise ValueError(
                f"expected z [T, {Dl}] and weights, indices [T, k]; got z {list(z.shape)}, weights "
                f"{list(weights.shape)}, indices {list(indices.shape)}"
            )
        k = indices.shape[1]
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of_slot = order // k
        counts = torch.bincount(flat, minlength=E).tolist()
        outs = []
        for e, x in enumerate(torch.split(z[token_of_slot], counts)):
            if counts[e] > 0:
                w1, w2, w3 = (w.dequantize(e, z.dtype) for w in (self.w1, self.w2, self.w3))
                outs.append(expert_mlp(x, w1, w2, w3, self.act))
        if not outs:
            return torch.zeros_like(z)
        y = torch.cat(outs).float() * weights.reshape(-1)[order].float()[:, None]
        out = torch.zeros(z.shape, dtype=torch.float32, device=z.device).index_add_(0, token_of_slot, y)
        return out.to(z.dtype)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> RoutedExperts:
        """A plain RoutedExperts holding the dequantized weights (the reference this module must match)."""
        E, I, Dl = self.w1.shape
        with torch.device("meta"):
            out = RoutedExperts(E, Dl, I, self.act, impl=self.impl)
        for name in ("w1", "w2", "w3"):
            setattr(out, name, nn.Parameter(getattr(self, name).dequantize(dtype=dtype)))
        return out

    def extra_repr(self) -> str:
        E, I, Dl = self.w1.shape
        return f"experts={E}, dim={Dl}, intermediate={I}, impl={self.impl}, mxfp4 packed"


def pack_model_experts(model: nn.Module) -> nn.Module:
    """Swap every RoutedExperts in `model` for a PackedRoutedExperts (in place; returns `model`).

    Real weights are quantized to MXFP4 (one expert at a time, then the high-precision module is dropped);
    weights on the meta device give empty packed buffers, to be filled with load_state_dict(assign=True).
    QAT modules are packed like plain ones; already packed modules are left alone.
    """
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]:
        if not name:
            raise ValueError("model is itself a RoutedExperts; use PackedRoutedExperts.from_experts(model)")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, PackedRoutedExperts.from_experts(m))
    return model


def expert_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by routed experts: {"packed": MXFP4 codes + scales, "dense": RoutedExperts tensors,
    "bf16_equivalent": what all of them would take in BF16}."""
    packed = dense = weights = 0
    for m in model.modules():
        if isinstance(m, PackedRoutedExperts):
            for w in (m.w1, m.w2, m.w3):
                packed += w.weight_packed.nbytes + w.weight_scale.nbytes
                weights += w.shape.numel()
        elif isinstance(m, RoutedExperts):
            for w in (m.w1, m.w2, m.w3):
                dense += w.nbytes
                weights += w.numel()
    return {"packed": packed, "dense": dense, "bf16_equivalent": 2 * weights}
