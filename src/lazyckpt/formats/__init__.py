"""Byte layouts only: torch.save's zip, safetensors, CRC32 (what is captured lazily: formats/capture.py)."""
