"""Tuning: the Optuna search over a family's Variants (tuner), the study that several processes
share (study: claims, heartbeats), one process per GPU of a host (host), one trial's render,
compile, check and time (trial) in worker processes (workers), the model presets that name
Problems, and the GPU clock both tuning and measuring read (timing). Imports the kernel machinery
and the store."""
