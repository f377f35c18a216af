"""What a run leaves behind, as a model people can use: `swarmpipe export`, `eval`, `generate`.

`export` assembles one step of a run's stage checkpoints into one safetensors file
(model/exported.py); `eval` measures its held-out loss as the run did; `generate`
samples text from it (model/sampling.py). Each command's module imports torch only
inside `serve`, so `swarmpipe --help` stays instant.
"""
