"""Model artifacts: GGUF and ONNX files, the local catalogue, quantizing, resumable downloads."""
