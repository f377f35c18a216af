"""Training data: byte-level samples that any head can rebuild from their global index.

`Corpus.load` reads the run's text (by default the standard library's .py
sources, present offline everywhere); `Corpus.samples(start, count)` is a pure
function of (text, seed, index), so a lease is just an index range and a
replayed lease yields the same samples; `Corpus.heldout` is the evaluation set.
"""

from swarmpipe.data.corpus import Corpus, default_corpus_files

__all__ = ["Corpus", "default_corpus_files"]
