"""Triton kernels of the OmniVoice techniques (each beside its torch reference)."""
