"""Build the native kernel library with nvcc (no torch headers: seconds, not a minute).

The library is cached under ``$NGRAM_KERNELS_CACHE`` (default ``~/.cache/ngram-corpus/kernels``)
in a folder named by a hash of the sources, the nvcc version and the flags, so a changed source or
compiler rebuilds and concurrent processes never see a half-written file (build to a temporary
name, then rename). ``python -m verifier.kernels.build`` builds it ahead of time.

Environment:
  NGRAM_NVCC            nvcc to use (default: $CUDA_HOME/bin/nvcc, then nvcc on PATH)
  NGRAM_CUDA_ARCHS      comma-separated SASS targets, e.g. "90,100" (default "90"); PTX for the
                        highest one is embedded too, so newer GPUs JIT-compile it
  NGRAM_KERNELS_CACHE   cache root
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
LIB_NAME = "libngram_verifier_kernels.so"


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message says which and carries nvcc's output."""


@dataclass(frozen=True)
class BuildConfig:
    nvcc: str = ""  # resolved by find_nvcc() when empty
    archs: tuple[str, ...] = ("90",)
    cache_root: Path = field(default_factory=lambda: default_cache_root())
    extra_flags: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.archs or not all(a.isdigit() for a in self.archs):
            raise ValueError(f"archs must be compute capabilities like '90', got {self.archs!r}")

    @classmethod
    def from_env(cls) -> "BuildConfig":
        archs = os.environ.get("NGRAM_CUDA_ARCHS", "90")
        return cls(nvcc=os.environ.get("NGRAM_NVCC", ""), archs=tuple(a.strip() for a in archs.split(",") if a.strip()))


def default_cache_root() -> Path:
    env = os.environ.get("NGRAM_KERNELS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ngram-corpus" / "kernels"


def find_nvcc(preferred: str = "") -> str | None:
    for candidate in (preferred, os.environ.get("NGRAM_NVCC", "")):
        if candidate:
            return candidate if shutil.which(candidate) else None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cu"))


def nvcc_flags(config: BuildConfig) -> list[str]:
    flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", "--threads", "0", "-lineinfo"]
    for arch in config.archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    top = max(config.archs, key=int)
    flags += ["-gencode", f"arch=compute_{top},code=compute_{top}"]  # PTX fallback
    return flags + list(config.extra_flags)


def _nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"cannot run {nvcc} --version: {e}") from e


def library_path(config: BuildConfig, nvcc: str) -> Path:
    h = hashlib.sha256()
    for src in sorted(CSRC.iterdir()):
        if src.suffix in (".cu", ".cuh", ".h"):
            h.update(src.name.encode())
            h.update(src.read_bytes())
    h.update(_nvcc_version(nvcc).encode())
    h.update(" ".join(nvcc_flags(config)).encode())
    return config.cache_root / h.hexdigest()[:16] / LIB_NAME


def build(config: BuildConfig | None = None, force: bool = False) -> Path:
    """Return the path of the built library, compiling it if the cache has none."""
    config = config or BuildConfig.from_env()
    nvcc = find_nvcc(config.nvcc)
    if nvcc is None:
        raise BuildError(
            "nvcc not found (set NGRAM_NVCC or CUDA_HOME, or put nvcc on PATH); "
            "the verifier kernels are compiled on first use"
        )
    out = library_path(config, nvcc)
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [nvcc, *nvcc_flags(config), *map(str, sources()), "-o", tmp]
    log.info("building verifier kernels: %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise BuildError(f"nvcc failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}{proc.stdout}")
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--archs", default=None, help='SASS targets, e.g. "90,100" (default: $NGRAM_CUDA_ARCHS or 90)')
    args = parser.parse_args(argv)
    config = BuildConfig.from_env()
    if args.archs:
        config = BuildConfig(nvcc=config.nvcc, archs=tuple(a.strip() for a in args.archs.split(",")))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(build(config, force=args.force))
    except BuildError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
