"""A local lm-eval task for exported PRISM models (docs/huggingface.md)."""
