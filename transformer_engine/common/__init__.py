"""Framework-independent pieces: FP8 recipes."""
