"""ForgeRL."""
