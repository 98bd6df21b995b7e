"""What several commands share: comma-separated integers, the causal choice, the benchmark suite's
options, and the --db option with the store it names, whose errors become clean command-line
errors."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from tunegen.tuning_db import Store

# --causal's choices and the causal values each stands for.
CAUSAL = {"both": (False, True), "yes": (True,), "no": (False,)}


def parse_ints(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


_SUITE_OPTIONS = (
    click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True),
    click.option(
        "--seqlens", callback=parse_ints, default="512,1024,2048,4096,8192,16384", show_default=True
    ),
    click.option("--head-dims", callback=parse_ints, default="64,128,256", show_default=True),
    click.option("--causal", type=click.Choice(list(CAUSAL)), default="both", show_default=True),
    click.option(
        "--tokens", type=int, default=16384, show_default=True, help="Tokens per batch: B = tokens / N."
    ),
    click.option("--hidden", type=int, default=2048, show_default=True, help="Hidden size: H = hidden / D."),
    click.option(
        "--kv-heads", type=int, default=None, help="Key/value heads (default: as many as query heads)."
    ),
)


def suite_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The FlashAttention papers' benchmark suite as options: dtype, lengths, head dims, causal,
    tokens per batch, hidden size and KV heads (`tunegen.measure.suites.prefill_suite`'s arguments)."""
    for option in reversed(_SUITE_OPTIONS):
        command = option(command)
    return command


def db_option(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--db",
        "db_url",
        default=None,
        metavar="URL",
        help="SQLAlchemy URL of the tuning database (default: TUNEGEN_DB, else the user's SQLite file).",
    )(command)


@contextlib.contextmanager
def opened_store(db_url: str | None, *, readonly: bool) -> Iterator[Store]:
    """Open the store; its errors and invalid input become clean command-line errors."""
    from tunegen.kernels.database import open_store
    from tunegen.tuning_db import TuningDbError

    try:
        with open_store(db_url, readonly=readonly) as store:
            yield store
    except (TuningDbError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
