"""Inference on a trained model: ``model.py`` builds a rank's tensor-parallel cut straight from
a checkpoint or a Hugging Face directory (only its slices are read), ``generate.py`` samples
tokens with a KV cache (``fived generate``, docs/generate.md)."""
