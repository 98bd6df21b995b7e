"""Measuring: `tunegen bench` against the peers (the suites, checked rows, bench, bench_fp8), the
roofline's ceilings, the HTML report, the memory calculator and `tunegen doctor`. Imports the kernel
machinery, tuning, and the public functions it times as users call them."""
