"""Pure tensor ops for k3: no nn.Module state, no torch.distributed, nothing heavy at import time.

Shape letters used in every docstring and shape suffix under `k3.ops`:

    B  batch                      T  time (tokens per sequence)
    H  heads                      K  key (and query) head dim
    V  value head dim             D  model width (hidden size)
    E  experts                    L  layers
    N  documents / sequences      C  chunk size (chunked linear attention)

Import the op you need from its module, e.g. `from k3.ops.kda import chunk_kda`.
"""
