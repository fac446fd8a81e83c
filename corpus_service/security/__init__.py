"""Who may call what: client tokens (``auth.py``), TLS (``tls.py``), rate limits (``rate_limit.py``),
the validation of those settings (``config.py``) and the loopback rule (``net.py``)."""
