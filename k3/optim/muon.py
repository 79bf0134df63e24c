"""Per-Head Muon: momentum -> Newton-Schulz orthogonalisation (per head block) -> RMS-matched update.

Muon (Jordan et al., https://kellerjordan.github.io/posts/muon/) replaces a matrix parameter's momentum
M by an approximation of its polar factor U V^T (M = U S V^T), computed with a few Newton-Schulz
iterations of the quintic X <- a X + (b A + c A^2) X, A = X X^T, coefficients (3.4445, -4.7750, 2.0315).
Moonlight / K2 ("Muon is Scalable for LLM Training", arXiv 2502.16982) multiply the orthogonalised
update by 0.2 * sqrt(max(rows, cols)) so its RMS matches AdamW's (~0.2), and use decoupled weight decay.

K3's "Per-Head Muon" (docs/spec_training.md#per-head-muon) orthogonalises each attention head's block of
a head-structured projection on its own: ``head_split=(0, H)`` cuts the rows into H equal blocks (q_b_proj
[H*192, r] -> H x [192, r]), ``head_split=(1, H)`` cuts the columns (o_proj [D, H*128] -> H x [D, 128]).
Blocks are orthogonalised as one batched Newton-Schulz call. 3-D parameters [E, out, in] (stacked routed
experts) are E independent matrices; a head split, if given, then applies to each expert's (out, in).

Numerics match ``torch.optim.Muon`` (torch 2.13, ``adjust_lr_fn="match_rms_adamw"``) exactly when head
splitting is off and ``ns_dtype=torch.bfloat16``: same EMA momentum (buf.lerp_(g, 1 - mu)), same Nesterov
blend, same Frobenius normalisation with eps clamp, same transpose of tall matrices, same fused
addmm-style iteration, weight decay with the un-adjusted lr. The only difference is the default
``ns_dtype=torch.float32`` (torch always iterates in bf16): the K3 spec asks for fp32 reductions, and at
our sizes the fp32 iteration is cheap next to the forward/backward. The momentum buffer is kept in fp32.

Layout (CONTRIBUTING.md#optimizer-maths-apart): pure maths (``newton_schulz``, ``muon_update``,
``orthogonalize``, ``update_scale``) first, the stateful ``Muon`` class last.
"""

import math

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
RMS_TARGET = 0.2  # AdamW's typical update RMS (Moonlight section 2.2)
RMS_SCALE_BY = ("block", "matrix")

HeadSplit = tuple[int, int] | None  # (axis, num_heads): axis 0 = rows, 1 = columns of each matrix


def newton_schulz(
    G: Tensor,
    steps: int = 5,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.float32,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
) -> Tensor:
    """Approximate polar factor of each matrix in G [..., rows, cols], batched over leading dims.

    Iterates in ``dtype`` (fp32 default; bf16 reproduces torch.optim.Muon bit for bit) and returns
    G's dtype. Singular values of the result land in roughly [0.7, 1.2], not exactly 1: the
    coefficients trade exactness for speed (see the Muon post). Tall matrices are transposed so the
    Gram matrix is the small side.
    """
    if G.ndim < 2:
        raise ValueError(f"G: expected a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    a, b, c = coefficients
    tall = G.size(-2) > G.size(-1)
    X = G.to(dtype)
    X = X.mT if tall else X
    batch_shape = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])
    # Frobenius norm >= spectral norm, so this puts every singular value in [0, 1].
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2, one rounding like torch's addmm
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    X = X.reshape(*batch_shape, *X.shape[-2:])
    return (X.mT if tall else X).to(G.dtype)


def muon_update(grad: Tensor, momentum_buf: Tensor, beta: float, nesterov: bool) -> Tensor:
    """Advance the momentum EMA in place and return the matrix to orthogonalise (same shape as grad).

    buf <- beta * buf + (1 - beta) * g;  update = (1 - beta) * g + beta * buf if nesterov else buf.
    This is torch's / Keller Jordan's EMA form; Moonlight's sum form (buf <- beta * buf + g) differs by
    the factor (1 - beta), which the Frobenius normalisation in newton_schulz removes.
    """
    momentum_buf.lerp_(grad.to(momentum_buf.dtype), 1 - beta)
    return grad.to(momentum_buf.dtype).lerp(momentum_buf, beta) if nesterov else momentum_buf


def check_head_split(shape: torch.Size, head_split: HeadSplit, name: str = "head_split") -> None:
    """Raise ValueError unless ``head_split`` is None or (axis in {0, 1}, H > 0) with H dividing that dim."""
    if head_split is None:
        return
    if len(head_split) != 2:
        raise ValueError(f"{name}: expected (axis, num_heads) or None, got {head_split!r}")
    axis, num_heads = head_split
    if axis not in (0, 1):
        raise ValueError(f"{name}: axis must be 0 (rows) or 1 (columns), got {axis}")
    dim = shape[-2 + axis]
    if num_heads <= 0 or dim % num_heads:
        raise ValueError(
            f"{name}: num_heads={num_heads} does not divide {'rows' if axis == 0 else 'columns'}={dim} "
            f"of shape {tuple(shape)}"
        )


def block_shape(shape: torch.Size, head_split: HeadSplit) -> tuple[int, int]:
    """(rows, cols) of the matrix Newton-Schulz actually sees for a parameter of ``shape``."""
    rows, cols = shape[-2], shape[-1]
    if head_split is None:
        return rows, cols
    axis, num_heads = head_split
    return (rows // num_heads, cols) if axis == 0 else (rows, cols // num_heads)


def orthogonalize(update: Tensor, head_split: HeadSplit = None, **ns_kwargs) -> Tensor:
    """Newton-Schulz on update [..., rows, cols], whole matrices or per head block; same shape out.

    head_split=(0, H): [..., H*br, c] -> [..., H, br, c]; (1, H): [..., r, H*bc] -> [..., H, r, bc].
    Every block is its own matrix in one batched call; blocks are put back where they came from.
    """
    check_head_split(update.shape, head_split)
    return _unblock(newton_schulz(_blocks(update, head_split), **ns_kwargs), update.shape, head_split)


def orthogonalize_many(items: list[tuple[Tensor, HeadSplit, dict]]) -> list[Tensor]:
    """`orthogonalize(update, head_split, **ns_kwargs)` for each (update, head_split, ns_kwargs) item,
    with every block of one shape and one set of Newton-Schulz settings across all items stacked into a
    single batched call: a model's few dozen small matrices then cost a few iterations of bmm instead of
    a few dozen (~1 ms each on a CPU, almost all of it per-call overhead). Same maths per block."""
    blocks, keys = [], []
    for update, head_split, ns_kwargs in items:
        check_head_split(update.shape, head_split)
        b = _blocks(update, head_split)  # [n, r, c]
        blocks.append(b)
        keys.append((tuple(b.shape[1:]), update.dtype, tuple(sorted(ns_kwargs.items()))))
    done: list[Tensor | None] = [None] * len(items)
    for key in dict.fromkeys(keys):
        idx = [i for i, k in enumerate(keys) if k == key]
        stacked = torch.cat([blocks[i] for i in idx]) if len(idx) > 1 else blocks[idx[0]]
        out = newton_schulz(stacked, **items[idx[0]][2]).split([blocks[i].shape[0] for i in idx])
        for i, o in zip(idx, out, strict=True):
            done[i] = _unblock(o, items[i][0].shape, items[i][1])
    return done


def _blocks(update: Tensor, head_split: HeadSplit) -> Tensor:
    """update [..., rows, cols] -> its Newton-Schulz matrices [n, r, c] (per head block when split)."""
    *lead, rows, cols = update.shape
    if head_split is None:
        return update.reshape(-1, rows, cols)
    axis, num_heads = head_split
    if axis == 0:
        return update.reshape(-1, rows // num_heads, cols)
    return (
        update.reshape(*lead, rows, num_heads, cols // num_heads)
        .transpose(-3, -2)
        .reshape(-1, rows, cols // num_heads)
    )


def _unblock(blocks: Tensor, shape: torch.Size, head_split: HeadSplit) -> Tensor:
    """The inverse of `_blocks`: [n, r, c] -> shape."""
    if head_split is None or head_split[0] == 0:
        return blocks.reshape(shape)
    *lead, rows, cols = shape
    num_heads = head_split[1]
    return blocks.reshape(*lead, num_heads, rows, cols // num_heads).transpose(-3, -2).reshape(shape)


def update_scale(shape: torch.Size, head_split: HeadSplit = None, rms_scale_by: str = "block") -> float:
    """RMS-matching factor 0.2 * sqrt(max(rows, cols)) of the block ("block") or whole matrix ("matrix").

    An orthogonal [m, n] matrix has RMS 1/sqrt(max(m, n)); the factor brings each orthogonalised block
    to RMS ~0.2. With "matrix" the blocks of a row split keep the full matrix's factor, so each block's
    update RMS is 0.2 * sqrt(H) (rows split, rows >= cols) -- the un-split Muon step size. For 3-D
    parameters the "matrix" is one expert.
    """
    if rms_scale_by not in RMS_SCALE_BY:
        raise ValueError(f"rms_scale_by: expected one of {RMS_SCALE_BY}, got {rms_scale_by!r}")
    rows, cols = block_shape(shape, head_split if rms_scale_by == "block" else None)
    return RMS_TARGET * math.sqrt(max(rows, cols))


class Muon(torch.optim.Optimizer):
    """Muon with per-head orthogonalisation for 2-D matrices and 3-D stacked experts [E, out, in].

    Group keys (defaults in brackets): lr, momentum [0.95], nesterov [True], weight_decay [0.1]
    (decoupled: p *= 1 - lr * wd), ns_steps [5], ns_dtype [fp32], eps [1e-7], head_split [None] --
    (axis, num_heads) applied to every parameter of the group --, per_head [True] (False ignores
    head_split), rms_scale_by ["block"]. The step is p -= lr * update_scale(...) * NS(momentum).
    Head metadata lives in the param group (not a dict keyed by tensor) so it survives state_dict().
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
        eps: float = NS_EPS,
        head_split: HeadSplit = None,
        per_head: bool = True,
        rms_scale_by: str = "block",
    ) -> None:
        for key, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if value < 0:
                raise ValueError(f"{key}: must be >= 0, got {value}")
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps,
            ns_dtype=ns_dtype, eps=eps, head_split=head_split, per_head=per_head, rms_scale_by=rms_scale_by,
        )  # fmt: skip
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group after checking every parameter is a 2-D/3-D real matrix its head_split divides."""
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()  # leave the optimizer as it was
            raise

    def _check_group(self, group: dict) -> None:
        if group["rms_scale_by"] not in RMS_SCALE_BY:
            raise ValueError(f"rms_scale_by: expected one of {RMS_SCALE_BY}, got {group['rms_scale_by']!r}")
        if group["head_split"] is not None:
            group["head_split"] = tuple(group["head_split"])
        for i, p in enumerate(group["params"]):
            where = f"parameter {i} of group {len(self.param_groups) - 1}"
            if p.ndim not in (2, 3) or torch.is_complex(p):
                raise ValueError(
                    f"params: Muon takes real 2-D matrices or 3-D stacked experts [E, out, in]; {where} has "
                    f"shape {tuple(p.shape)}, dtype {p.dtype} (vectors, scalars, norms go to AdamW)"
                )
            check_head_split(p.shape, group["head_split"], name=f"head_split ({where})")

    @torch.no_grad()
    def step(self, closure=None):
        """One optimisation step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batched = type(self)._orthogonalize is Muon._orthogonalize  # (a subclass may shard its tensors)
        pending = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if batched:
                        pending.append((p, group, self._momentum(p, group)))
                    else:
                        self._step_param(p, group)
        if pending:
            updates = orthogonalize_many([(u, *self._ns_args(g)) for _, g, u in pending])
            for (p, group, _), update in zip(pending, updates, strict=True):
                self._apply(p, group, update)
        return loss

    def _momentum(self, p: Tensor, group: dict) -> Tensor:
        """Advance p's momentum and return the matrix to orthogonalise."""
        if p.grad.is_sparse:
            raise ValueError("params: Muon does not support sparse gradients")
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        return muon_update(p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"])

    @staticmethod
    def _ns_args(group: dict) -> tuple[HeadSplit, dict]:
        head_split = group["head_split"] if group["per_head"] else None
        return head_split, dict(steps=group["ns_steps"], eps=group["eps"], dtype=group["ns_dtype"])

    def _apply(self, p: Tensor, group: dict, update: Tensor) -> None:
        head_split = self._ns_args(group)[0]
        scale = update_scale(p.shape, head_split, group["rms_scale_by"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"] * scale)

    def _step_param(self, p: Tensor, group: dict) -> None:
        """One parameter's step through `_orthogonalize` (the path of subclasses that override it)."""
        update = self._momentum(p, group)
        head_split, ns_kwargs = self._ns_args(group)
        self._apply(p, group, self._orthogonalize(p, update, head_split, ns_kwargs))

    def _orthogonalize(self, p: Tensor, update: Tensor, head_split, ns_kwargs: dict) -> Tensor:
        """The orthogonalized update of `p`; the distributed optimizer overrides this (sharded tensors)."""
        return orthogonalize(update, head_split, **ns_kwargs)
