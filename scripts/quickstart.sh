#!/usr/bin/env bash
# The README's quick start, run as written by tests/test_quickstart.py: everything below the marker
# line is the README's "Quick start" block, verbatim. Run it from an activated venv (bash run.sh or
# bash .ci/run make .venv; then . .venv/bin/activate) in any directory: it writes fib.py there.
set -euo pipefail
# --- README quick start ---
GRPC_PORT=${GRPC_PORT:-50051} ADMIN_PORT=${ADMIN_PORT:-8080} API_PORT=${API_PORT:-8000}
trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT   # stops both servers when the script ends

# 1. The corpus service, with a namespace for SmolLM2 (its tokenizer, so uploads can be text).
ngram-corpus serve --grpc-port $GRPC_PORT --admin-port $ADMIN_PORT \
    --namespace smollm2:vocab=49152,tokenizer=smollm2 &
curl -sf --retry 60 --retry-connrefused --retry-delay 1 127.0.0.1:$ADMIN_PORT/readyz; echo

# 2. Upload a corpus: here one file of code (blank-line-separated text; .jsonl and token ids work too).
#    The corpus keeps its uploads, so --replace: a second run swaps in this file instead of failing (409).
cat > fib.py <<'EOF'
def fibonacci(n):
    if n <= 0:
        return 0
    elif n <= 1:
        return n
    else:
        fib_sequence = [0, 1]
        for i in range(2, n + 1):
            fib_sequence.append(fib_sequence[i - 1] + fib_sequence[i - 2])
        return fib_sequence[n]
EOF
ngram-corpus upload fib.py --name code --namespace smollm2 --replace --admin-url http://127.0.0.1:$ADMIN_PORT --quiet

# 3. The verifier (CPU; SmolLM2-135M-Instruct's Q4_1 GGUF in float32), drafting from the corpus' smollm2 namespace.
ngram-verifier serve --model smollm2 --corpus 127.0.0.1:$GRPC_PORT --device cpu --port $API_PORT &
curl -sf --retry 120 --retry-connrefused --retry-delay 1 127.0.0.1:$API_PORT/healthz; echo

# 4. A chat request with curl; "usage" counts the draft tokens accepted.
curl -s 127.0.0.1:$API_PORT/v1/chat/completions -d '{"messages": [{"role": "user",
    "content": "Write a Python function that returns the n-th Fibonacci number."}], "max_tokens": 64, "temperature": 0}'
echo
# Steps drafted by the corpus service ("remote"), and accepted tokens that only its trees drafted
# (here: from the upload, which this verifier's own in-process drafts cannot know).
curl -s 127.0.0.1:$API_PORT/metrics | grep -E '^ngram_verifier_(draft_steps|accepted_draft_tokens|remote_gain_tokens)'

# 5. The same request with the official openai client (pip install openai).
API_PORT=$API_PORT python3 - <<'EOF'
import os
from openai import OpenAI

client = OpenAI(base_url=f"http://127.0.0.1:{os.environ['API_PORT']}/v1", api_key="unused")
model = client.models.list().data[0].id
reply = client.chat.completions.create(
    model=model, max_tokens=64, temperature=0,
    messages=[{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}])
print(reply.model_dump_json())
EOF

# 6. The corpus' side: drafts served, committed tokens, the uploaded corpus.
ngram-corpus stats --admin-url http://127.0.0.1:$ADMIN_PORT
