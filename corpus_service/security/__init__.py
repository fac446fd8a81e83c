"""Who may call what: client tokens (``auth.py``), TLS (``tls.py``), rate limits (``rate_limit.py``),
and the validation of those settings (``config.py``); the loopback rule is ``ngram_common.net``'s."""
