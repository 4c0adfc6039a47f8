"""Renderers of a finished Session: text, JSON, TensorBoard. They never touch hooks."""
