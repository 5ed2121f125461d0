"""What a level is: ``Level`` (a folder or URL, how often, how many kept, replicas) and the names of the
checkpoints in it (``step-<8 digits>`` files and folders). Saving to levels is ``lazyckpt.schedule``,
reading them back ``lazyckpt.resume``, node-loss replicas ``lazyckpt.cluster``."""

from lazyckpt.errors import LevelError, MemoryLevelWarning

from ._level import FOLDER_RE, Level, Naming, as_level, check_step, list_steps, step_name, step_of

__all__ = [
    "FOLDER_RE",
    "Level",
    "LevelError",
    "MemoryLevelWarning",
    "Naming",
    "as_level",
    "check_step",
    "list_steps",
    "step_name",
    "step_of",
]
