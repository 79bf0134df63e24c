"""Quantization-aware training of the routed experts by module swap (docs/spec.md#mxfp4,
docs/spec_training.md#qat).

K3 was trained from SFT on with MXFP4 routed-expert weights and MXFP8 activations, so that the MXFP4
release loses nothing. `convert_qat(model)` replaces every `RoutedExperts` with a `QATRoutedExperts`
holding the *same* Parameter objects (same state_dict keys, optimizer state stays valid), whose forward
runs the expert maths on fake-quantized tensors:

    w1, w3 [E, I, Dl] -> MXFP4, blocks of 32 along Dl (their input dim)
    w2     [E, Dl, I] -> MXFP4, blocks of 32 along I  (its input dim)
    z      [T, Dl]    -> MXFP8 E4M3 before w1 / w3
    GLU(g, u) [n, I]  -> MXFP8 E4M3 before w2

Master weights stay in their own dtype; the backward is straight-through (`fake_quant_mx`), i.e. the
gradient of a master weight is the gradient with respect to its quantized value. Everything else (attention,
latent down/up projections and norm, shared experts, router, embeddings, lm_head) is untouched, as in the
release.

Turning QAT on mid-run (`k3 train --qat mx --qat-from-step N`): convert before the optimizer, compile or
sharding wrap the model with `enabled=False`, then call `maybe_enable_qat(model, step, N)` every step; the
switch is a flag, so no module or parameter changes identity at step N. See docs/quantization.md.
"""

from dataclasses import dataclass

import torch
from torch import nn

from k3.model.moe import RoutedExperts
from k3.ops.mx import BLOCK_SIZE, fake_quant_mx, get_format


@dataclass(frozen=True)
class QATRecipe:
    """Which MX formats the expert weights and their input activations are fake-quantized to."""

    weight_fmt: str
    act_fmt: str


RECIPES = {"mx": QATRecipe(weight_fmt="mxfp4", act_fmt="mxfp8_e4m3")}


def get_recipe(recipe: str | QATRecipe) -> QATRecipe:
    if isinstance(recipe, QATRecipe):
        for fmt in (recipe.weight_fmt, recipe.act_fmt):
            get_format(fmt)  # raises ValueError naming an unknown format
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is not a QAT recipe; expected one of {sorted(RECIPES)}")
    return RECIPES[recipe]


class QATRoutedExperts(RoutedExperts):
    """RoutedExperts whose forward fake-quantizes w1/w2/w3 and their inputs (when `qat_enabled`).

    Same parameters, shapes and forward signature as RoutedExperts:
    forward(z [T, Dl], weights [T, k], indices [T, k], impl=None) -> u [T, Dl].
    """

    def __init__(self, *args, recipe: str | QATRecipe = "mx", enabled: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.recipe, self.qat_enabled = get_recipe(recipe), enabled

    @classmethod
    def from_experts(
        cls, experts: RoutedExperts, recipe: str | QATRecipe = "mx", enabled: bool = True
    ) -> "QATRoutedExperts":
        """A QATRoutedExperts sharing `experts`' Parameter objects (built on meta, then they are assigned)."""
        return _swap_class(experts, cls, recipe=get_recipe(recipe), qat_enabled=enabled)

    def compute(self, fn, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if not self.qat_enabled:
            return super().compute(fn, z, weights, indices)
        wq, aq, act = self.recipe.weight_fmt, self.recipe.act_fmt, self.act

        def act_fq(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return fake_quant_mx(act(gate, up), aq)  # the input of w2

        w1, w2, w3 = (fake_quant_mx(w, wq) for w in (self.w1, self.w2, self.w3))
        return fn(fake_quant_mx(z, aq), weights, indices, w1, w2, w3, act_fq)

    def extra_repr(self) -> str:
        r = self.recipe
        return f"{super().extra_repr()}, qat={r.weight_fmt}/{r.act_fmt}, enabled={self.qat_enabled}"


def _swap_class(old: RoutedExperts, cls: type, **attrs) -> RoutedExperts:
    """A new `cls` module with old's act/impl/init_std/training flag and the very same w1/w2/w3 Parameters."""
    E, I, Dl = old.w1.shape
    with torch.device("meta"):  # allocate nothing: the parameters are replaced right away
        new = cls(E, Dl, I, old.act, old.init_std, old.impl)
    for name in ("w1", "w2", "w3"):
        setattr(new, name, getattr(old, name))
    for name, value in attrs.items():
        setattr(new, name, value)
    return new.train(old.training)


def _check_widths(name: str, experts: RoutedExperts) -> None:
    """MX blocks run along each weight's input dim: Dl for w1/w3, I for w2; both must be multiples of 32."""
    E, I, Dl = experts.w1.shape
    for param, width, what in (("w1", Dl, "Dl"), ("w3", Dl, "Dl"), ("w2", I, "I")):
        if width % BLOCK_SIZE != 0:
            raise ValueError(
                f"{name}.{param}: input dim {what}={width} is not a multiple of the MX block size "
                f"{BLOCK_SIZE}"
            )


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _routed_experts(model: nn.Module) -> list[tuple[str, RoutedExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]


def convert_qat(model: nn.Module, recipe: str | QATRecipe = "mx", enabled: bool = True) -> nn.Module:
    """Swap every RoutedExperts in `model` for a QATRoutedExperts (in place; returns `model`).

    Idempotent: already converted modules get the new recipe and `enabled` flag. Raises ValueError naming
    the parameter if an expert input width is not a multiple of 32 (checked before anything is swapped).
    Forward hooks registered on the old expert modules are not carried over.
    """
    rec = get_recipe(recipe)
    found = _routed_experts(model)
    for name, m in found:
        _check_widths(name or "experts", m)
    for name, m in found:
        if isinstance(m, QATRoutedExperts):
            m.recipe, m.qat_enabled = rec, enabled
        elif not name:
            raise ValueError("model is itself a RoutedExperts; use QATRoutedExperts.from_experts(model, ...)")
        else:
            _replace(model, name, QATRoutedExperts.from_experts(m, rec, enabled))
    return model


def unconvert_qat(model: nn.Module) -> nn.Module:
    """Inverse of convert_qat: every QATRoutedExperts back to a plain RoutedExperts (same Parameters)."""
    for name, m in _routed_experts(model):
        if isinstance(m, QATRoutedExperts) and name:
            _replace(model, name, _swap_class(m, RoutedExperts))
    return model


def set_qat_enabled(model: nn.Module, enabled: bool) -> int:
    """Turn fake quantization of every QATRoutedExperts on or off; returns how many modules were set."""
    mods = [m for _, m in _routed_experts(model) if isinstance(m, QATRoutedExperts)]
    for m in mods:
        m.qat_enabled = enabled
    return len(mods)


def qat_enabled(model: nn.Module) -> bool:
    """True iff the model has routed experts and all of them fake-quantize."""
    mods = [m for _, m in _routed_experts(model)]
    return bool(mods) and all(isinstance(m, QATRoutedExperts) and m.qat_enabled for m in mods)


def maybe_enable_qat(
    model: nn.Module, step: int, from_step: int | None, recipe: str | QATRecipe = "mx"
) -> bool:
    """The trainer's per-step hook for `--qat-from-step`: QAT is on at every step >= from_step.

    Call before the forward of optimizer step `step` (0-based, the same counter that is checkpointed, so
    a resumed run switches at the same step). from_step None means QAT is off. Returns whether QAT is on.
    If the model was converted up front (`convert_qat(model, enabled=False)`, the recommended wiring) this
    only flips flags; otherwise it swaps the modules at step `from_step`: the optimizer keeps working (the
    Parameters are the same objects), but a model already wrapped per module (FSDP) must not be swapped.
    """
    if from_step is None or step < from_step:
        return False
    if not qat_enabled(model):
        convert_qat(model, recipe, enabled=True)
    return True
