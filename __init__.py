"""swarmpipe: pipeline-parallel training across unreliable, unequal computers on slow links."""

__version__ = "0.1.0"
