"""Where bytes go: the local filesystem (every syscall) and the remote tier (fsspec URLs)."""
