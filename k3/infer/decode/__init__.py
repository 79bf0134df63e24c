"""The engine's decode backends, one-token rows in, logits out (same contract, tests compare them):
`torch_step` (the reference; compilable at batch 1) and `native_step` (the whole model in one C call);
`backend.DecodeStep` picks one when the engine is built."""
