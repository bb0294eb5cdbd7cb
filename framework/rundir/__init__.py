"""A run's model directory: its checkpoints (`checkpoints`), the lock that keeps one writer
(`lock`), and what a run restores and saves there (`run_state`)."""
