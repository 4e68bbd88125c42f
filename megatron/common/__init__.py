"""Stdlib-only helpers every layer uses (atomic file writes)."""
