"""dflash: train DFlash speculative-decoding drafters offline from a hidden-state store."""

__version__ = "0.1.0"
