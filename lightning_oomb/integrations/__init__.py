"""Model-library adapters (at the side of the engine)."""
