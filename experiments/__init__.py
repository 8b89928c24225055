"""slotlab package."""
