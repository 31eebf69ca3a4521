"""PyTorch-style layers written as plain ``@autostate.stateful`` classes."""

from __future__ import annotations

__all__: list[str] = []
