"""Which parameter goes to which optimizer: Per-Head Muon for hidden matrices, AdamW for the rest.

The table is docs/spec_training.md#per-head-muon (see docs/optimizer.md); H is the layer's head count:

| parameter (leaf name inside its module)                          | optimizer | head_split |
|------------------------------------------------------------------|-----------|------------|
| MLA `q_b_proj` (or `q_proj`), `kv_b_proj`, `g_proj`              | Muon      | (0, H)     |
| KDA `q_proj`, `k_proj`, `v_proj`, `f_b_proj`, `g_proj`/`g_b_proj`| Muon      | (0, H)     |
| MLA / KDA `o_proj`                                               | Muon      | (1, H)     |
| any other 2-D / 3-D weight (q_a_proj, kv_a_proj_with_mqa,        | Muon      | None       |
|   f_a_proj, b_proj, dense / shared / latent projections, router  |           |            |
|   `gate.weight`, stacked experts [E, out, in] = E matrices)      |           |            |
| `embed_tokens`, `lm_head`                                        | AdamW     | wd         |
| norms, AttnRes pseudo-queries `*_res_proj` [1, D], `A_log`,      | AdamW     | no wd      |
|   `dt_bias`, `*_conv1d.weight` [C, 1, W], every other 1-D tensor |           |            |
| `e_score_correction_bias` (a buffer: Quantile Balancing writes it) | none    | —          |

`per_head=False` (`--no-per-head`, and the K2 recipe) keeps the same groups with every head_split
dropped: whole-matrix Muon. `optimizer="adamw"` puts everything in AdamW (the ablation baseline).
`check_coverage` asserts the groups hold every trainable parameter exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MLAAttention

_MLA_ROW_SPLIT = ("q_b_proj", "q_proj", "kv_b_proj", "g_proj")
_KDA_ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_proj", "g_b_proj")
_COL_SPLIT = ("o_proj",)


@dataclass
class ParamGroups:
    """Names per group. `muon` maps a head_split (None = whole matrix) to the parameter names."""

    muon: dict[tuple[int, int] | None, list[str]] = field(default_factory=dict)
    adamw_decay: list[str] = field(default_factory=list)
    adamw_no_decay: list[str] = field(default_factory=list)

    def all_names(self) -> list[str]:
        return [n for names in self.muon.values() for n in names] + self.adamw_decay + self.adamw_no_decay


def _head_split(module: nn.Module, leaf: str) -> tuple[int, int] | None:
    """head_split of parameter `<leaf>.weight` inside attention module `module` (None: whole matrix)."""
    heads = module.num_heads
    rows = _MLA_ROW_SPLIT if isinstance(module, MLAAttention) else _KDA_ROW_SPLIT
    if leaf in rows:
        return (0, heads)
    if leaf in _COL_SPLIT:
        return (1, heads)
    return None


def _attention_splits(model: nn.Module) -> dict[str, tuple[int, int] | None]:
    """Full parameter name -> head_split for every weight directly owned by an MLA / KDA projection."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, MLAAttention | KimiDeltaAttention):
            for child, sub in module.named_children():
                if isinstance(sub, nn.Linear):
                    out[f"{name}.{child}.weight"] = _head_split(module, child)
    return out


def _is_decayed_adamw(name: str) -> bool:
    return name == "lm_head.weight" or name.endswith("embed_tokens.weight")


def _is_adamw(name: str, p: torch.Tensor) -> bool:
    return p.ndim < 2 or _is_decayed_adamw(name) or name.endswith(("_res_proj.weight", "conv1d.weight"))


def classify(model: nn.Module, per_head: bool = True, optimizer: str = "muon") -> ParamGroups:
    """Assign every trainable parameter of `model` to a group (see the module table)."""
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"optimizer: expected 'muon' or 'adamw', got {optimizer!r}")
    splits = _attention_splits(model)
    groups = ParamGroups()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if _is_decayed_adamw(name) or (optimizer == "adamw" and p.ndim >= 2 and not _is_adamw(name, p)):
            groups.adamw_decay.append(name)
        elif _is_adamw(name, p):
            groups.adamw_no_decay.append(name)
        else:
            split = splits.get(name) if per_head else None
            groups.muon.setdefault(split, []).append(name)
    check_coverage(model, groups)
    return groups


def check_coverage(model: nn.Module, groups: ParamGroups) -> None:
    """Raise ValueError unless the groups hold every trainable parameter of `model` exactly once."""
    names = groups.all_names()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    dupes = sorted({n for n in names if names.count(n) > 1})
    missing = sorted(set(trainable) - set(names))
    extra = sorted(set(names) - set(trainable))
    if dupes or missing or extra:
        raise ValueError(f"param groups: duplicated {dupes}, missing {missing}, not trainable {extra}")


def build_optimizers(
    model: nn.Module,
    *,
    optimizer: str = "muon",
    per_head: bool = True,
    lr: float = 0.02,
    adamw_lr: float = 3e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    betas: tuple[float, float] = (0.9, 0.95),
    muon_class: type | None = None,
) -> list[torch.optim.Optimizer]:
    """[Muon, AdamW] (or [AdamW] for optimizer="adamw"); every group records its `base_lr` for schedules.
    `muon_class`: a Muon subclass (k3.parallel.muon_dist.DistMuon for sharded parameters)."""
    from k3.optim import Muon

    muon_class = muon_class or Muon

    groups = classify(model, per_head, optimizer)
    params = dict(model.named_parameters())
    opts: list[torch.optim.Optimizer] = []
    if groups.muon:
        muon_groups = [
            {"params": [params[n] for n in names], "head_split": split, "base_lr": lr, "lr": lr}
            for split, names in sorted(groups.muon.items(), key=lambda kv: str(kv[0]))
        ]
        opts.append(muon_class(muon_groups, lr=lr, momentum=momentum, weight_decay=weight_decay))
    adamw_groups = [
        {"params": [params[n] for n in names], "weight_decay": wd, "base_lr": adamw_lr, "lr": adamw_lr}
        for names, wd in ((groups.adamw_decay, weight_decay), (groups.adamw_no_decay, 0.0))
        if names
    ]
    opts.append(torch.optim.AdamW(adamw_groups, lr=adamw_lr, betas=betas, eps=1e-8, foreach=False))
    return opts
