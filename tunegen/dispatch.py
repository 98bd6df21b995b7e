"""Dispatch: the kernel that serves a Problem on a Gpu, built once and then kept in a dict.

Until the tuner's Winners are served here, the kernel is the family's default Variant.
"""

from __future__ import annotations

import threading

from tunegen.families import base, get
from tunegen.gpu import Gpu
from tunegen.problem import Problem

_KERNELS: dict[tuple[Problem, Gpu], base.Kernel] = {}
_BUILD_LOCK = threading.Lock()


def kernel_for(problem: Problem, gpu: Gpu) -> base.Kernel:
    """The kernel for `problem` on `gpu`; the first call for a Problem renders and imports it."""
    key = (problem, gpu)
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _BUILD_LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                family = get(problem.family)
                kernel = base.build(family, family.default_variant(problem, gpu), problem, gpu)
                _KERNELS[key] = kernel
    return kernel
