"""Load the nvcc-built kernel library with ctypes and call its `extern "C"` entry points.

Each entry point takes raw device pointers, sizes and a cudaStream_t, and returns 0 or an error
code whose message (with the file:line that detected it) comes from ``ngk_last_error()``.
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import c_float, c_int, c_int64, c_void_p

ABI_VERSION = 5

_P = c_void_p  # every pointer argument, passed as an int from tensor.data_ptr()
_SIGNATURES = {
    # name: argument types after the pointers' count is spelled out (stream last)
    "ngk_tree_indices_from_mask": [_P, _P, _P, _P, _P, _P, c_int, c_int, _P],
    "ngk_tree_indices_from_parents": [_P, _P, _P, _P, _P, _P, _P, c_int, c_int, _P],
    "ngk_verify_tree_greedy": [_P] * 8 + [c_int, c_int, c_int, _P],
    "ngk_tree_speculative_sampling": [_P] * 10 + [c_int, c_int, c_int, c_int, c_float, c_float, _P],
    "ngk_tree_sampling_logits": [c_int] + [_P] * 16 + [c_int, c_int, c_int, c_int, c_float, c_float, _P],
    "ngk_logit_floor_rows": [c_int, _P, c_int64, c_int, _P, _P, _P, _P, _P],
    "ngk_tree_attention_mask_dense": [_P, _P, _P, c_int, c_int, c_int64, _P],
    "ngk_tree_attention_mask_flat": [_P, _P, _P, _P, c_int, c_int, _P],
    "ngk_compact_kv_cache": [_P, _P, _P, _P, c_int, c_int, c_int, c_int, c_int64, c_int64, _P],
    "ngk_rope_store_kv": [c_int] + [_P] * 8 + [c_int] * 4 + [_P],
    "ngk_decode_attention": [c_int, _P, _P, _P, _P, c_int64, _P, _P, _P, _P, _P, c_int64] + [c_int] * 6 + [c_float, _P],
    "ngk_argmax_rows": [c_int, _P, c_int64, c_int64, _P, _P, _P],
    "ngk_silu_mul": [c_int, _P, _P, c_int64, c_int64, _P],
    "ngk_norm_linear": [c_int, c_int, c_int, _P, _P, _P, _P, c_float, _P, _P, _P, c_int, c_int, c_int, _P],
}


class NativeKernelError(RuntimeError):
    """The library could not be built/loaded, or a kernel reported a CUDA error."""


class _Library:
    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.lib.ngk_last_error.restype = ctypes.c_char_p
        self.lib.ngk_abi_version.restype = c_int
        if self.lib.ngk_abi_version() != ABI_VERSION:
            raise NativeKernelError(f"{path}: ABI version {self.lib.ngk_abi_version()}, expected {ABI_VERSION}")
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes = argtypes
            fn.restype = c_int

    def call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise NativeKernelError(f"{name} failed: {self.lib.ngk_last_error().decode()}")


_lock = threading.Lock()
_library: _Library | None = None
_load_error: str | None = None


def _config_for_current_device():
    """Default archs plus the current GPU's own when it predates the default (PTX cannot go back)."""
    import torch

    from .build import BuildConfig

    config = BuildConfig.from_env()
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        cc = str(major * 10 + minor)
        if cc not in config.archs and int(cc) < min(int(a) for a in config.archs):
            config = BuildConfig(nvcc=config.nvcc, archs=(cc, *config.archs), cache_root=config.cache_root)
    return config


def library() -> _Library:
    """The loaded library, building it on first use; raises NativeKernelError saying why not."""
    global _library, _load_error
    if _library is not None:
        return _library
    with _lock:
        if _library is None:
            if _load_error is not None:
                raise NativeKernelError(_load_error)
            try:
                from .build import build

                _library = _Library(build(_config_for_current_device()))
            except Exception as e:  # BuildError, OSError from dlopen, ABI mismatch
                _load_error = f"verifier kernels unavailable: {type(e).__name__}: {e}"
                raise NativeKernelError(_load_error) from e
    return _library


def available() -> bool:
    try:
        library()
        return True
    except NativeKernelError:
        return False
