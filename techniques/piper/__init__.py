"""Techniques for the Piper family (`orchestrate.families.piper`): the onnxruntime session's
settings, an int8 graph, sentence batching, and the synthesis scales as knobs."""
