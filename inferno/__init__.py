"""Inferno, an open LLM serving system; `inferno.client` is the Python client of its NATS API."""
