"""Evaluation through the real runtime: perplexity, retrieval (pass key / copy needle), plots."""
