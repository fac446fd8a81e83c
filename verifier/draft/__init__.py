"""Drafting: the ``Drafter`` (the corpus, remote or in process, with the in-process fallback), the
remote client in a child process, the corpus' health, the adaptive remote ask and the external
corpora loaded at start-up."""
