"""The kernel machinery: what a kernel is for (Problem, Gpu) and which one (Variant); the families
(space, constraints, launcher, reference, peers) in `families/`; rendering templates, compiling
offline and binding a compiled kernel once (launcher); dispatch, which finds a call's Winner in a
per-process snapshot of the store (snapshot, database) or falls back to the family's defaults.
Imports only templates and the store."""
