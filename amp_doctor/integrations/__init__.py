"""Callbacks for training frameworks: ``amp_doctor.integrations.transformers`` (Hugging Face
``Trainer``) and ``amp_doctor.integrations.lightning`` (PyTorch Lightning).

Each is imported on its own, so that ``import amp_doctor`` never imports a framework.
"""

from __future__ import annotations

__all__: list[str] = []
