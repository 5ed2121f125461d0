"""How a checkpoint becomes visible: folder markers, prefixes at URLs, the distributed two-phase commit."""
