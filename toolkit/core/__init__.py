"""The bottom layer: errors, file writes, the component registry, locks and preflight checks.

Everything else may import it; it imports no other toolkit package (see docs/design.md).
"""
