"""`tunegen render`: the Triton source a family's Variant renders to, for a Problem described by
options and a GPU class."""

from __future__ import annotations

import json
from typing import Any

import click

from tunegen.cli.options import COUNT, HEAD_DIM, check_kv_heads


@click.command()
@click.argument("family", type=click.Choice(["prefill", "backward"]))
@click.option("--head-dim", type=HEAD_DIM, default=128, show_default=True, help="Head dimension D.")
@click.option("--causal/--no-causal", default=False, show_default=True)
@click.option(
    "--dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default="bfloat16", show_default=True
)
@click.option("--heads", type=COUNT, default=32, show_default=True, help="Query heads.")
@click.option(
    "--kv-heads", type=COUNT, default=None, help="Key/value heads, a divisor of --heads (default: --heads)."
)
@click.option("--varlen", is_flag=True, help="Packed sequences with cu_seqlens.")
@click.option("--return-lse", is_flag=True, help="Also store the log-sum-exp.")
@click.option("--unaligned", is_flag=True, help="Inputs whose strides are not 16-byte multiples.")
@click.option(
    "--gpu",
    "gpu_kind",
    type=click.Choice(["auto", "hopper", "ampere", "interpreter"]),
    default="auto",
    show_default=True,
    help="GPU class whose default Variant to start from.",
)
@click.option(
    "--variant", "variant_json", default=None, help="Knobs to override, as JSON: '{\"block_m\": 64}'."
)
def render(
    family: str,
    head_dim: int,
    causal: bool,
    dtype: str,
    heads: int,
    kv_heads: int | None,
    varlen: bool,
    return_lse: bool,
    unaligned: bool,
    gpu_kind: str,
    variant_json: str | None,
) -> None:
    """Print the Triton source a Variant of FAMILY renders to."""
    import torch
    import triton

    from tunegen.kernels import families
    from tunegen.kernels import render as rendering
    from tunegen.kernels.gpu import Gpu, gpu_of
    from tunegen.kernels.problem import Problem

    check_kv_heads(heads, kv_heads)
    if gpu_kind == "auto":
        gpu = gpu_of(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    else:
        # A GPU of that class with this installation's Triton and torch: what would compile it.
        capability = {"hopper": (9, 0), "ampere": (8, 0), "interpreter": (0, 0)}[gpu_kind]
        backend = "interpreter" if gpu_kind == "interpreter" else "cuda"
        gpu = Gpu(gpu_kind, capability, 1, 0, triton.__version__, torch.__version__, backend)
    problem = Problem(
        family=family,
        dtype=dtype,
        head_dim=head_dim,
        causal=causal,
        num_heads_q=heads,
        num_heads_kv=kv_heads or heads,
        batch=1,
        seqlen_q=1,
        seqlen_k=1,
        varlen=varlen,
        return_lse=return_lse,
        aligned=not unaligned,
    )
    fam = families.get(family)
    variant = fam.default_variant(problem, gpu)
    try:
        if variant_json:
            variant = _overridden(fam, variant, variant_json)
        fam.check_variant(variant, problem, gpu)
    except (ValueError, TypeError) as exc:
        raise click.BadParameter(str(exc), param_hint="--variant") from None
    click.echo(rendering.render(fam.template, family, variant, fam.features(problem, gpu)).source, nl=False)


def _overridden(family: Any, default: Any, text: str) -> Any:
    """`default` with the knobs `text` gives (JSON); those that no longer apply (another
    schedule's, by the family's conditions) back to their defaults, so that '{"schedule": "fa2"}'
    on a Hopper GPU whose default is "ws" gives FlashAttention-2's loop with its own knobs."""
    try:
        knobs = json.loads(text)
    except json.JSONDecodeError:
        knobs = None
    if not isinstance(knobs, dict):
        raise ValueError(f"expected a JSON object of knobs such as '{{\"block_m\": 64}}', got {text!r}")
    values = {**default.as_dict(), **knobs}
    blank = family.variant_type().as_dict()
    for name, (parent, allowed) in family.conditions.items():
        if name not in knobs and values.get(parent) not in allowed:
            values[name] = blank[name]
    return family.variant_type.from_json(values)
