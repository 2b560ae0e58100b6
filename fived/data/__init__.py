"""The real-data path: tokenizers, ``fived data prepare``, token shards and the loader.

``meta`` (torch-free: the directory's metadata and the vocabulary rule), ``tokenizer``,
``prepare`` (inputs -> shards), ``shards`` (memory-mapped reading), ``loader`` (the global
batch of a step as a pure function of (seed, step, directory), prefetched), ``vocab`` (the
padded-logit mask). Nothing here imports torch at package import time.
"""
