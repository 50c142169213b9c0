"""Conversion between axtorch models and other ecosystems' checkpoints."""
