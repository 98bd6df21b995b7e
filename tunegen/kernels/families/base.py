"""What every kernel family provides, and the compiled Kernel it hands to dispatch."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import torch

from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import Rendered, load, render
from tunegen.kernels.variant import Variant


@dataclasses.dataclass(frozen=True)
class Case:
    """One Problem's fresh random inputs: a kernel's launch on them, its error against float64
    (NaN when an output was left unwritten), the peers that compute the same function, and the
    positional and keyword arguments of the public call a user makes on them (where the family has
    one that takes them as they are; `tunegen.measure.bench` times it)."""

    launch: Callable[[], None] | None
    error: Callable[[], float]
    peers: dict[str, Callable[[], Any]]
    peer_error: Callable[[Any], float]
    public: tuple[tuple[Any, ...], dict[str, Any]] | None = None


def generator(device: torch.device, seed: int) -> torch.Generator | None:
    """A generator on `device` seeded with `seed` for a case's inputs; none on "meta", whose
    tensors are shapes only (the inputs tuning's compile workers bind kernels to)."""
    if device.type == "meta":
        return None
    return torch.Generator(device).manual_seed(seed)


def normal(
    shape: tuple[int, ...],
    gen: torch.Generator | None,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Standard normal values drawn by `gen` (see `generator`) on `device`; on "meta" the tensor
    alone, without a draw: torch draws meta values through a path whose first use imports
    torch._dynamo (1.4 s of each compile worker's first compile on the CI machine)."""
    if device.type == "meta":
        return torch.empty(shape, device=device, dtype=dtype)
    return torch.randn(shape, generator=gen, device=device, dtype=dtype)


SOFTCAP = 50.0  # the cap a softcap Problem is tuned with (Gemma 2's on attention scores)


def case_features(problem: Problem, gen: torch.Generator | None, device: torch.device) -> dict[str, Any]:
    """A tuning case's features of current models as the public calls and the float64 references
    take them: `problem`'s window and chunk, the cap at SOFTCAP, and sink logits drawn by `gen`
    (one per query head; None without sinks)."""
    return {
        "window_size": (problem.window_left, problem.window_right),
        "attention_chunk": problem.attention_chunk,
        "softcap": SOFTCAP if problem.softcap else 0.0,
        "sinks": normal((problem.num_heads_q,), gen, device) if problem.sinks else None,
    }


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A Variant rendered for one Problem's features and imported: `launch` runs it; `bind` takes
    one call's arguments and returns the bound call for all arguments of their launch key (see
    tunegen.kernels.launcher), which `launch` also goes through."""

    variant: Variant
    rendered: Rendered
    launch: Callable[..., None]
    bind: Callable[..., Callable[..., None]]


class Family(Protocol):
    """One kernel family: its template, Variant type, features, defaults and validity rules."""

    name: str
    template: str
    variant_type: type[Variant]
    # Knobs that matter only for some values of another knob: knob -> (that knob, those values).
    # Elsewhere the knob keeps its default and the tuner does not search it.
    conditions: ClassVar[dict[str, tuple[str, tuple]]]
    # The features of current models (`Problem.model_features`' names) its templates render, and
    # those they render for FP8 Problems.
    model_features: ClassVar[frozenset[str]]
    fp8_model_features: ClassVar[frozenset[str]]

    def features(self, problem: Problem, gpu: Gpu) -> dict[str, Any]:
        """The Problem's features the template renders away, for this Gpu."""
        ...

    def default_variant(self, problem: Problem, gpu: Gpu) -> Variant:
        """A sensible Variant when no Winner is known."""
        ...

    def deterministic(self, variant: Variant, problem: Problem, gpu: Gpu) -> Variant:
        """`variant`, or the closest Variant that runs `problem` on `gpu` giving the same bits on
        every run of the same inputs (what torch.use_deterministic_algorithms asks for)."""
        ...

    def check_variant(self, variant: Variant, problem: Problem, gpu: Gpu) -> None:
        """Raise ValueError if `variant` cannot run `problem` on `gpu`."""
        ...

    def search_space(self, problem: Problem, gpu: Gpu) -> dict[str, list]:
        """The tuner's knobs and their candidate values."""
        ...

    def constraint(self, variant: Variant, problem: Problem, gpu: Gpu) -> str | None:
        """Why `variant` should not be compiled for `problem` on `gpu` (None if it should)."""
        ...

    def case(self, problem: Problem, kernel: Kernel | None, device: Any, seed: int) -> Case:
        """Inputs for `problem` bound to `kernel` (None: peers only), with the float64 check."""
        ...

    def measure(self, problem: Problem) -> tuple[str, float]:
        """What a run's speed is counted in: ("TFLOP/s", FLOPs) or ("GB/s", bytes moved)."""
        ...


def choose(family: Family, space: dict[str, list], pick: Callable[[str, list], Any]) -> dict[str, Any]:
    """One point of a search space: `pick` chooses each knob's value in the space's order, except
    knobs that do not apply given the values chosen before them (the family's conditions), which
    keep their defaults; a knob whose parent does not apply does not apply either."""
    defaults = family.variant_type()
    chosen: dict[str, Any] = {}
    skipped: set[str] = set()
    for name, values in space.items():
        condition = family.conditions.get(name)
        if condition is not None:
            parent, allowed = condition
            if parent in skipped or chosen.get(parent, getattr(defaults, parent)) not in allowed:
                skipped.add(name)
                continue
        chosen[name] = pick(name, values)
    return chosen


def applicable(family: Family, variant: Variant, problem: Problem, gpu: Gpu) -> dict[str, Any]:
    """The knobs of `variant` that mean something for `problem` on `gpu`, as listings show them:
    those the tuner chooses there (more than one candidate in the search space, and not ruled out
    by the family's conditions given the Variant's own values), plus every knob off its default,
    so that `family.variant_type.from_json` of the result rebuilds `variant` exactly."""
    values = variant.as_dict()
    space = family.search_space(problem, gpu)
    chosen = choose(family, space, lambda name, _: values[name])
    defaults = family.variant_type().as_dict()
    return {
        name: value
        for name, value in values.items()
        if (name in chosen and len(space[name]) > 1) or value != defaults[name]
    }


def grid(family: Family, space: dict[str, list]) -> Iterator[Variant]:
    """Every distinct Variant of a search space that the Variant type accepts, in order."""
    seen = set()
    for values in itertools.product(*space.values()):
        point = dict(zip(space, values, strict=True))
        chosen = choose(family, space, lambda name, _, point=point: point[name])
        key = tuple(sorted(chosen.items()))
        if key in seen:
            continue
        seen.add(key)
        try:
            yield family.variant_type(**chosen)
        except ValueError:
            continue


def unrendered(family: Family, problem: Problem) -> str | None:
    """Why no Variant of `family` runs `problem`: the features of current models it asks for
    (`Problem.model_features`) that the family's templates do not render (`Family.model_features`,
    or for FP8 `Family.fp8_model_features`); None where they render them all. `build` refuses such
    a Problem, and the tuner skips it."""
    rendered = family.fp8_model_features if problem.fp8 else family.model_features
    names = sorted(set(problem.model_features) - rendered)
    if not names:
        return None
    fp8 = " for FP8" if problem.fp8 else ""
    return f"the {family.name} kernels do not render {names}{fp8} in this release"


def build(family: Family, variant: Variant, problem: Problem, gpu: Gpu) -> Kernel:
    """Check, render and import one Variant of `family` for `problem` on `gpu`; refuses a Problem
    with features that the family's templates do not render (`unrendered`), rather than build a
    kernel that would ignore them."""
    refused = unrendered(family, problem)
    if refused:
        raise ValueError(f"problem: {refused}; call without them")
    family.check_variant(variant, problem, gpu)
    rendered = render(family.template, family.name, variant, family.features(problem, gpu))
    module = load(rendered, interpret=gpu.backend == "interpreter")
    return Kernel(variant=variant, rendered=rendered, launch=module.launch, bind=module.bind)
