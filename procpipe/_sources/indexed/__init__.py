"""Indexed sources: a dataset read by index (``len`` and ``[i]``), in batches of indices."""
