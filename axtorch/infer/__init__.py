"""Inference: token sampling and KV-cache generation."""
