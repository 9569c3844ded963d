"""Re-exports (filled in as the modules land)."""
