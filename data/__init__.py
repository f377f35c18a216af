"""Training data: byte-level samples that any head can rebuild from their global index."""

from swarmpipe.data.corpus import Corpus, default_corpus_files

__all__ = ["Corpus", "default_corpus_files"]
