"""Roles: what each of the four models does, wherever it runs (``protocols`` names the seams)."""
