"""Names of the files in a DCP checkpoint folder that lazyckpt writes or reads (byte layout lives in DCP)."""

METADATA = ".metadata"  # DCP's own: written last; makes the folder a checkpoint
MANIFEST = ".lazyckpt-manifest.json"  # lazyckpt's: every file's size and CRC32, every item's bounds
DATA_SUFFIX = ".distcp"  # a rank's data file
