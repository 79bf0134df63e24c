"""Training K3 models: the K3 recipe end to end.

* ``config``        TrainConfig + recipe functions (the `k3 train` demo, K3 / K2 recipes, a nano smoke run)
* ``param_groups``  Per-Head Muon vs AdamW routing (docs/spec_training.md#per-head-muon) with a coverage check
* ``step``          one optimizer step: grad accumulation, NaN guard, clipping, QK-Clip, Quantile Balancing
* ``trainer``       the loop: time budget, eval / checkpoint cadence, Ctrl-C, resume
* ``checkpointing`` atomic, pickle-free training checkpoints (model, optimizers, RNG, data position)
* ``evaluate``      validation loss, bits per byte, unigram baseline, samples
* ``metrics``       metrics.jsonl, loss.png, progress bar, FLOPs / MFU, summary table
* ``report``        the end of a run: final eval, export, sample, summary
* ``runtime``       LocalRuntime: the trainer's device calls in one process
* ``distributed``   DistributedRuntime: the same calls on a dp x ep mesh (k3.parallel), DCP checkpoints
* ``vl``            `k3 train --task vision`: the image-text loop on a VL preset
* ``ablate``        `k3 ablate`: K3 vs K2 and single-component swaps
* ``cli``           `k3 train | eval | sample | ablate`

Nothing is imported here, so `import k3.train.cli` stays cheap. See docs/training.md.
"""
