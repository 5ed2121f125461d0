"""Byte layouts only: torch.save's zip, safetensors, the pickler that flattens state, CRC32."""
