"""Leaf helpers that the corpus service and the verifier both use, kept here once: whether a host
is loopback (``net.py``: the rule behind both servers' off-loopback requirements) and the GGUF
tokenizer with the namespace probe text (``tokenizer.py``: the corpus encodes uploads and the probe
with it, the verifier's model its prompts) and the servers' start-up heap frozen out of the garbage
collector's scans (``gc_heap.py``). This package imports neither ``corpus_service`` nor
``verifier``, so neither import can form a circle through it."""
