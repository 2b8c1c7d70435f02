"""OmniVoice 0.2.1: masked diffusion over 8 Higgs codebooks, through the `omnivoice` package.

The family plugin is `family.OmniVoiceFamily` (entry point `orchestrate.families:
omnivoice`); importing it needs `omnivoice` (and so torchaudio), `presets` alone does not.
Its techniques live in `orchestrate.techniques.omnivoice`.
"""
