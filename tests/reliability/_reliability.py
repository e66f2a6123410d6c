"""The configuration the reliability tests train (imported by name; `conftest` is ambiguous between
tests/ and tests/reliability/)."""
CONFIG = "configs/debug_cpu"
# save_every_steps and keep_checkpoints are outside the config fingerprint: runs that differ only in them
# train the same model and may resume each other's checkpoints.
REFERENCE = ("save_every_steps=5", "keep_checkpoints=20", "frequent=1")
