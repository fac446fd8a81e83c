"""The REST admin (``app.py``) and its command-line client (``client.py``): the catalog of external
corpora, uploads, build jobs and the data directory they persist to."""
