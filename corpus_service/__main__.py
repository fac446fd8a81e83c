"""``python -m corpus_service ...`` is ``ngram-corpus ...``."""

import sys

from corpus_service.cli import main

sys.exit(main())
