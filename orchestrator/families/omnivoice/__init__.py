"""OmniVoice 0.2.1: masked diffusion over 8 Higgs codebooks, through the `omnivoice` package.

Importing this package needs `omnivoice` (and so torchaudio); `presets` alone does not.
"""

from orchestrator.families.omnivoice.family import OmniVoiceFamily

FAMILY = OmniVoiceFamily()
