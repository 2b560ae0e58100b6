"""Ranks and where they run: the grid (coordinates and groups) and the launcher."""
