"""Embedded defaults: what dflash runs on when the user brings no model or data."""
