"""The engine: save planning, jobs, staging and writing, host buffers, the guard, handles, removal."""
