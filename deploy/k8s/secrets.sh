#!/usr/bin/env bash
# Creates the secrets that the manifests in deploy/k8s reference, each with fresh random values:
#   ngram-corpus-admin    token                   the corpus' admin token (uploads, deletes, gRPC admin calls)
#   ngram-corpus-clients  tokens.json             the corpus' client tokens: the verifiers' (role draft on
#                                                 the smollm2 namespace), stored as its SHA-256 only
#   ngram-corpus-tls      tls.crt, tls.key, ca.crt  the corpus' certificate (gRPC and admin TLS) for
#                                                 ngram-corpus, ngram-corpus.NAMESPACE[.svc[.cluster.local]]
#                                                 and localhost (kubectl port-forward), and the private CA
#                                                 that signed it (the CA's key is not kept)
#   ngram-verifier        api-key, corpus-token   the verifiers' OpenAI API key and their corpus client token
# A secret that already exists is kept (delete it to have it made anew; ngram-corpus-clients and
# ngram-verifier go together: the first holds the hash of the second's corpus-token).
#
#   deploy/k8s/secrets.sh [--namespace NAMESPACE] [--corpus-namespace NS] [--out DIR]
#
# --namespace: the Kubernetes namespace (default ngram-corpus, as deploy/k8s/kustomization.yaml).
# --corpus-namespace: the corpus namespace the verifiers' token may draft from (default smollm2).
# --out DIR: write the Secret manifests into DIR instead of applying them (nothing is sent anywhere).
# Needs kubectl and openssl. With cert-manager, a Certificate whose secretName is ngram-corpus-tls and
# whose dnsNames are the names above replaces the TLS part.
set -euo pipefail

NAMESPACE=ngram-corpus
CORPUS_NS=smollm2
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --namespace) NAMESPACE="${2:?--namespace needs a value}"; shift 2 ;;
    --corpus-namespace) CORPUS_NS="${2:?--corpus-namespace needs a value}"; shift 2 ;;
    --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "secrets.sh: unknown argument '$1' (expected --namespace, --corpus-namespace, --out or --help)" >&2; exit 2 ;;
  esac
done
for tool in kubectl openssl; do
  command -v "$tool" >/dev/null || { echo "secrets.sh: $tool is needed and not on PATH" >&2; exit 2; }
done

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
umask 077

exists() {  # a secret that is there already is kept
  [ -z "$OUT" ] && kubectl get secret "$1" --namespace "$NAMESPACE" >/dev/null 2>&1
}

emit() {  # NAME, then kubectl create secret arguments: applied, or written to --out
  local name="$1"; shift
  if [ -n "$OUT" ]; then
    kubectl create secret "$@" --namespace "$NAMESPACE" --dry-run=client -o yaml > "$OUT/$name.yaml"
    echo "secrets.sh: wrote $OUT/$name.yaml"
  else
    kubectl create secret "$@" --namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
    echo "secrets.sh: created secret $NAMESPACE/$name"
  fi
}

random() { printf '%s' "$(openssl rand -hex 24)"; }  # single-line values: no trailing newline

if [ -n "$OUT" ]; then
  mkdir -p "$OUT"
else
  kubectl get namespace "$NAMESPACE" >/dev/null 2>&1 || kubectl create namespace "$NAMESPACE" >/dev/null
fi

if exists ngram-corpus-admin; then
  echo "secrets.sh: keeping secret $NAMESPACE/ngram-corpus-admin"
else
  random > "$WORK/admin-token"
  emit ngram-corpus-admin generic ngram-corpus-admin --from-file=token="$WORK/admin-token"
fi

if exists ngram-corpus-clients && exists ngram-verifier; then
  echo "secrets.sh: keeping secrets $NAMESPACE/ngram-corpus-clients and $NAMESPACE/ngram-verifier"
else
  random > "$WORK/api-key"
  random > "$WORK/corpus-token"
  sha="$(openssl dgst -sha256 -r < "$WORK/corpus-token" | cut -d' ' -f1)"
  printf '{"clients": [{"name": "verifier", "token_sha256": "%s", "namespaces": ["%s"], "role": "draft"}]}\n' \
    "$sha" "$CORPUS_NS" > "$WORK/tokens.json"
  emit ngram-corpus-clients generic ngram-corpus-clients --from-file=tokens.json="$WORK/tokens.json"
  emit ngram-verifier generic ngram-verifier --from-file=api-key="$WORK/api-key" \
    --from-file=corpus-token="$WORK/corpus-token"
fi

if exists ngram-corpus-tls; then
  echo "secrets.sh: keeping secret $NAMESPACE/ngram-corpus-tls"
else
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 825 \
    -subj "/CN=ngram-corpus CA ($NAMESPACE)" -keyout "$WORK/ca.key" -out "$WORK/ca.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=ngram-corpus" \
    -keyout "$WORK/tls.key" -out "$WORK/tls.csr" 2>/dev/null
  cat > "$WORK/ext.cnf" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=DNS:ngram-corpus,DNS:ngram-corpus.$NAMESPACE,DNS:ngram-corpus.$NAMESPACE.svc,DNS:ngram-corpus.$NAMESPACE.svc.cluster.local,DNS:localhost
EXT
  openssl x509 -req -in "$WORK/tls.csr" -CA "$WORK/ca.crt" -CAkey "$WORK/ca.key" -CAcreateserial -days 825 \
    -extfile "$WORK/ext.cnf" -out "$WORK/tls.crt" 2>/dev/null
  emit ngram-corpus-tls generic ngram-corpus-tls --type=kubernetes.io/tls --from-file=tls.crt="$WORK/tls.crt" \
    --from-file=tls.key="$WORK/tls.key" --from-file=ca.crt="$WORK/ca.crt"
fi
