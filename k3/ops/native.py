"""Small C kernels, compiled on first use, for the few CPU hot spots torch has no fast op for.

Sources live in `k3/ops/csrc/<name>.c` and the headers beside it (plain C, no torch headers, so a build
takes about a second). `library(name)` compiles one with the system C compiler (`$CC`, else `cc` /
`gcc`) into `$K3_CACHE_DIR/native/<key>/lib<name>.so` (default `~/.cache/k3`), where the key hashes the
source, the headers, compiler, flags and this CPU's feature flags (`-march=native` code must never run
on another CPU), and loads it with ctypes. The cache loads only what it built itself: the folders are
created private (0700), a library is loaded only from folders this user owns that no one else may
write, and only when its SHA-256 equals the one written beside it at build time (`lib<name>.so.sha256`);
a library that fails the hash is built again. Without a compiler, on a failed build or with `K3_NATIVE=0`
it returns None after one warning, and every caller takes its torch path instead: each kernel has a
torch reference with the same contract, and the tests compare them (docs/decisions.md, "native
kernels").
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
# no errno from math calls, no reliance on floating-point traps: both let gcc vectorise sqrt, exp
# polynomials and branchless clamps; a*b+c may become one fused multiply-add (rounded once); no
# -ffast-math: no reassociation, no reciprocal approximations
FLAGS = (
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast",
    "-shared", "-fPIC", "-std=c11",
)  # fmt: skip
# kernels that run a thread team (OpenMP: the runtime torch itself loads, so one pool of threads)
_TEAM_KERNELS = (
    "decode_step", "moe_experts", "mla_stream", "kda_pointwise", "omp_pool", "rms_norm", "attn_res",
    "situ_glu", "cross_entropy", "kda_state", "unit_lower_solve",
)  # fmt: skip
EXTRA_FLAGS = {name: ("-fopenmp",) for name in _TEAM_KERNELS}
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
build_seconds = 0.0  # spent compiling kernels in this process (a run's fixed cost, k3.train.trainer)


def enabled() -> bool:
    """False when the environment turns native kernels off (K3_NATIVE=0)."""
    return os.environ.get("K3_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def compiler() -> str | None:
    """The C compiler to use: $CC if set (even when missing: then None), else cc or gcc on PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return shutil.which("cc") or shutil.which("gcc")


def library(name: str) -> ctypes.CDLL | None:
    """The compiled `csrc/<name>.c` as a ctypes library, or None (see the module docstring); cached."""
    if not enabled():
        return None
    with _lock:
        if name not in _libs:
            _libs[name] = _build_and_load(name)
        return _libs[name]


PTR, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float  # the kernels' argument types


def function(name: str, symbol: str, argtypes: list):
    """C function `symbol` of library `name` with its argument types set (every kernel returns void),
    or None when the library is not built (the caller takes its torch path)."""
    lib = library(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    if fn.argtypes is None:
        fn.argtypes, fn.restype = argtypes, None
    return fn


def release_thread_pool() -> bool:
    """Let the calling thread's OpenMP worker threads exit (csrc/omp_pool.c says why: a second pool in
    the process makes every team's barriers sleep). Call it on a thread that has run torch's parallel
    ops and hands the model to another thread. True when the runtime released it; False without the
    kernel library or when the runtime refused (e.g. inside a parallel region)."""
    lib = library("omp_pool")
    if lib is None:
        return False
    fn = lib.k3_release_thread_pool
    fn.argtypes, fn.restype = [], ctypes.c_int
    return fn() == 0


def flush_denormals_team(on: bool) -> bool:
    """Flush denormals (or stop) on every thread of the calling thread's OpenMP pool, which torch's
    parallel ops and MKL's products run on (torch.set_flush_denormal changes the calling thread only).
    False without the kernel library (the workers then keep their mode)."""
    lib = library("omp_pool")
    if lib is None:
        return False
    fn = lib.k3_flush_denormals_team
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    fn(1 if on else 0, max(1, torch.get_num_threads()))
    return True


_SGEMM: list = []  # [address of torch's BLAS sgemm_ or None], looked up once


def blas_sgemm() -> int | None:
    """The address of the Fortran-ABI `sgemm_` that torch links (MKL in the x86 wheels), for kernels that
    run their matrix products through it (the same kernels torch.mm runs); None where torch's library
    does not export it (the caller takes its torch path)."""
    if not _SGEMM:
        address = None
        lib_dir = Path(torch.__file__).parent / "lib"
        for path in sorted(lib_dir.glob("libtorch_cpu.*")):
            try:
                address = ctypes.cast(ctypes.CDLL(str(path)).sgemm_, ctypes.c_void_p).value
                break
            except (OSError, AttributeError):
                continue
        _SGEMM.append(address)
    return _SGEMM[0]


def fp32_cpu(*tensors) -> bool:
    """Whether every tensor is fp32 on the CPU: the only kind the kernels read or write."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def kernel_may_run(*tensors) -> bool:
    """Whether a kernel may replace the torch ops on these tensors: fp32 CPU (`fp32_cpu`), no gradient to
    record, and torch.compile not tracing (a traced graph keeps the torch ops: no opaque C calls)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return fp32_cpu(*tensors) and not grad and not torch.compiler.is_compiling()


def kernel_function(name: str, symbol: str, argtypes: list, *tensors):
    """`function(name, symbol, argtypes)` when `kernel_may_run(*tensors)` holds, else None: the one test every
    inference-only kernel's caller makes before taking it over its torch path."""
    return function(name, symbol, argtypes) if kernel_may_run(*tensors) else None


def reset() -> None:
    """Forget loaded libraries (tests switch compilers / K3_NATIVE between calls)."""
    with _lock:
        _libs.clear()


def _build_and_load(name: str) -> ctypes.CDLL | None:
    source = CSRC / f"{name}.c"
    cc = compiler()
    if cc is None:
        return _unavailable(name, "no C compiler found (set CC, or install gcc)")
    flags = (*FLAGS, *EXTRA_FLAGS.get(name, ()))
    path = _cache_dir() / _key(source, cc, flags) / f"lib{name}.so"
    if not _intact(path):
        t0 = time.perf_counter()
        error = _compile(cc, source, path, flags)
        global build_seconds
        build_seconds += time.perf_counter() - t0
        if error:
            return _unavailable(name, error)
    unsafe = _unsafe_folder(path)
    if unsafe:
        return _unavailable(name, unsafe)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        return _unavailable(name, f"loading {path} failed: {e}")


def _compile(cc: str, source: Path, path: Path, flags: tuple[str, ...]) -> str | None:
    """Compile to a temporary file beside `path`, then rename it into place (concurrent builders, e.g.
    the ranks of one job, each write their own file; the last rename wins, all with the same bytes)."""
    try:
        path.parent.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        unsafe = _unsafe_folder(path)
        if unsafe:
            return unsafe
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
    except OSError as e:  # e.g. a read-only home: no cache, no kernel
        return f"cannot write the kernel cache {path.parent}: {e}"
    try:
        cmd = [cc, *flags, "-I", str(source.parent), "-o", tmp, str(source)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            return f"`{cc} {' '.join(flags)} {source.name}` failed: {run.stderr.strip()[-500:]}"
        digest = _sha256(Path(tmp))
        os.replace(tmp, path)
        _write_private(Path(f"{path}.sha256"), digest)
        return None
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"running {cc} failed: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_private(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _intact(path: Path) -> bool:
    """Whether `path` is the library this cache built: its hash is the one recorded at build time."""
    try:
        return path.is_file() and Path(f"{path}.sha256").read_text().strip() == _sha256(path)
    except OSError:
        return False


def _unsafe_folder(path: Path) -> str | None:
    """Why a library in `path`'s folder must not be loaded (a folder or file another user owns or may
    write), else None."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    for p in (path.parent.parent, path.parent, path):
        try:
            st = p.stat()
        except OSError:
            continue  # not built yet (the caller builds it, in folders it made private)
        if uid is not None and st.st_uid != uid:
            return f"refusing the kernel cache {p}: owned by another user"
        if st.st_mode & 0o022:
            return f"refusing the kernel cache {p}: writable by other users (chmod go-w)"
    return None


def _unavailable(name: str, why: str) -> None:
    warnings.warn(f"k3 native kernel {name!r} unavailable, using the torch path: {why}", stacklevel=3)
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("K3_CACHE_DIR") or "~/.cache/k3").expanduser() / "native"


def _key(source: Path, cc: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        h.update(header.read_bytes())
    h.update(" ".join((cc, *flags, platform.machine(), _cpu_flags())).encode())
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    """This CPU's model and feature flags (Linux), or the processor string elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
