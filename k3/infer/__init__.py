"""Inference engine: paged MLA latents, per-slot KDA states, an exact hybrid prefix cache.

Request flow: `Engine.add_request` -> `Scheduler` (continuous batching, chunked prefill, preemption;
pure Python) -> `ModelRunner` (owns the device caches, calls the model) -> `sampler` -> outputs.
"""
