"""Criteo-format input pipelines (see tf_sok.data)."""
