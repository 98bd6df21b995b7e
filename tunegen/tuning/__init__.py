"""Tuning: the Optuna search over a family's Variants (tuner), one trial's render, compile, check
and time (trial) in worker processes (workers), the model presets that name Problems, and the
GPU clock both tuning and measuring read (timing). Imports the kernel machinery and the store."""
