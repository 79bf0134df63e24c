"""Optimizer maths and state for K3; knows nothing about the model (docs/spec_training.md#per-head-muon,
docs/spec_training.md#qk-clip).

* ``muon``     -- Per-Head Muon: ``newton_schulz``, ``muon_update``, ``orthogonalize``, ``update_scale``
                  (pure) and the ``Muon`` optimizer. AdamW (torch's) takes every other parameter.
* ``schedule`` -- ``warmup_cosine``, ``wsd`` (lr multipliers as pure functions of step), ``lr_scheduler``.
* ``qk_clip``  -- ``qk_clip_``: K2's per-head QK-Clip on an MLA layer's q_b_proj / kv_b_proj weights.

Metadata contract for the parameter-group builder (k3/train/param_groups.py, written elsewhere):
it maps model parameter names to optimizers and hands ``Muon`` ordinary torch param groups whose
extra key ``head_split`` describes every parameter of the group:

  head_split = None           plain Muon on the whole matrix (q_a_proj, kv_a_proj_with_mqa, f_a_proj,
                              b_proj, dense / shared / latent projections, router);
  head_split = (0, H)         rows are H contiguous equal head blocks (q_b_proj, kv_b_proj, g_proj,
                              KDA q/k/v_proj, f_b_proj);
  head_split = (1, H)         columns are H contiguous equal head blocks (o_proj);
  3-D tensors [E, out, in]    E independent expert matrices (stacked routed experts); a head_split,
                              if any, applies to each expert's (out, in).

Group parameters with the same split together, e.g.
``Muon([{"params": q_b_and_g, "head_split": (0, 96)}, {"params": o_projs, "head_split": (1, 96)},
{"params": the_rest}], lr=..., weight_decay=0.1)``. Muon raises ValueError for a parameter that is not a
real 2-D/3-D tensor or whose split dim is not divisible by H. It cannot tell an embedding or lm_head
(2-D, but AdamW's) from a hidden matrix: that routing, and the check that Muon + AdamW cover every
parameter exactly once, are the builder's job. ``e_score_correction_bias`` is in neither optimizer.
QK-Clip needs, per MLA layer, the head dims (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) and the
per-head max logits of the step; the trainer calls ``qk_clip_`` after ``Muon.step()``.
"""

from k3.optim.muon import Muon, muon_update, newton_schulz, orthogonalize, update_scale
from k3.optim.qk_clip import clip_factors, qk_clip_
from k3.optim.schedule import lr_scheduler, warmup_cosine, wsd

__all__ = [
    "Muon",
    "clip_factors",
    "lr_scheduler",
    "muon_update",
    "newton_schulz",
    "orthogonalize",
    "qk_clip_",
    "update_scale",
    "warmup_cosine",
    "wsd",
]
