"""What several commands share: integer options with the range each must lie in, the causal
choice, the benchmark suite's options and their checks, the attention of current models (window,
chunk, cap, sinks), and the --db option with the store it names, whose errors become clean
command-line errors."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from tunegen.tuning_db import Store

# --causal's choices and the causal values each stands for.
CAUSAL = {"both": (False, True), "yes": (True,), "no": (False,)}
# Head dims the kernels take (the public functions' range).
MAX_HEAD_DIM = 256


class Ints(click.ParamType):
    """Comma-separated integers (with `many=False`, one integer), each at least `minimum`, at most
    `maximum` and a multiple of `step`: counts and sizes that must make sense before any work starts
    (a zero length divides by zero, an empty list tunes nothing). An error names the option (click
    adds it), the rule and the value given."""

    def __init__(self, minimum: int = 1, maximum: int | None = None, *, step: int = 1, many: bool = True):
        self.minimum = minimum
        self.maximum = maximum
        self.step = step
        self.many = many
        self.name = "integers" if many else "integer"

    def rule(self) -> str:
        """What each value must be, as errors say it."""
        if self.step > 1:
            return f"{'0 or ' if self.minimum == 0 else ''}a positive multiple of {self.step}"
        if self.maximum is not None:
            return f"from {self.minimum} to {self.maximum}"
        return f"at least {self.minimum}"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, (tuple, int)):  # a default given as numbers, or a value converted before
            numbers = value if isinstance(value, tuple) else (value,)
        else:
            parts = [x.strip() for x in str(value).split(",")] if self.many else [str(value).strip()]
            try:
                numbers = tuple(int(x) for x in parts if x)
            except ValueError:
                numbers = None
        rule = self.rule()
        if self.many:
            expected = f"comma-separated integers, each {rule}"
        else:
            expected = rule if self.step > 1 else f"an integer {rule}"
        if not numbers:
            self.fail(f"expected {expected}, got {value!r}", param, ctx)
        for n in numbers:
            if n < self.minimum or (self.maximum is not None and n > self.maximum) or n % self.step:
                where = f" in {value!r}" if self.many else ""
                self.fail(f"expected {expected}, got {n}{where}", param, ctx)
        return numbers if self.many else numbers[0]


class Window(Ints):
    """LEFT,RIGHT: FlashAttention's `window_size`, two integers of at least -1 (-1: unbounded)."""

    def __init__(self) -> None:
        super().__init__(-1)
        self.name = "window"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        sides = super().convert(value, param, ctx)
        if len(sides) != 2:
            self.fail(f"expected LEFT,RIGHT: two integers, each at least -1, got {value!r}", param, ctx)
        return sides


# Lengths, batch sizes and other counts; head dims; page sizes (0: a contiguous cache).
COUNTS = Ints()
COUNT = click.IntRange(min=1)
HEAD_DIMS = Ints(1, MAX_HEAD_DIM)
HEAD_DIM = click.IntRange(1, MAX_HEAD_DIM)
PAGE_SIZES = Ints(0, step=16)
PAGE_SIZE = Ints(0, step=16, many=False)
WINDOW_OPTION = click.option(
    "--window",
    type=Window(),
    default="-1,-1",
    show_default=True,
    metavar="LEFT,RIGHT",
    help="Sliding window, FlashAttention's window_size: each row at position p sees keys p - LEFT to "
    "p + RIGHT (-1: unbounded; RIGHT 0 is causal; bottom-right aligned).",
)


def check_kv_heads(heads: int, kv_heads: int | None) -> None:
    """Refuse key/value heads that do not divide the query heads (GQA shares each KV head among
    a whole group of query heads)."""
    if kv_heads is not None and heads % kv_heads:
        raise click.BadParameter(
            f"expected a divisor of the query heads ({heads}), got {kv_heads}", param_hint="--kv-heads"
        )


def check_suite(head_dims: Sequence[int], hidden: int, kv_heads: int | None = None) -> None:
    """Refuse a benchmark suite whose heads (H = hidden / D) come out empty for a head dim, or
    whose key/value heads do not divide them."""
    if hidden < max(head_dims):
        raise click.BadParameter(
            f"H = hidden / D needs at least the largest head dim ({max(head_dims)}), got {hidden}",
            param_hint="--hidden",
        )
    for d in head_dims:
        check_kv_heads(hidden // d, kv_heads)


_SUITE_OPTIONS = (
    click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True),
    click.option("--seqlens", type=COUNTS, default="512,1024,2048,4096,8192,16384", show_default=True),
    click.option("--head-dims", type=HEAD_DIMS, default="64,128,256", show_default=True),
    click.option("--causal", type=click.Choice(list(CAUSAL)), default="both", show_default=True),
    click.option(
        "--tokens", type=COUNT, default=16384, show_default=True, help="Tokens per batch: B = tokens / N."
    ),
    click.option(
        "--hidden", type=COUNT, default=2048, show_default=True, help="Hidden size: H = hidden / D."
    ),
    click.option(
        "--kv-heads",
        type=COUNT,
        default=None,
        help="Key/value heads, a divisor of H (default: as many as query heads).",
    ),
)


_LOCAL_OPTIONS = (
    WINDOW_OPTION,
    click.option(
        "--chunk",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Chunked local attention (Llama 4: 8192): each row sees only its own chunk of keys (0: none).",
    ),
    click.option(
        "--softcap",
        type=click.FloatRange(min=0),
        default=0.0,
        show_default=True,
        help="Logit cap (Gemma 2: 50): scores become softcap * tanh(score / softcap) (0: none).",
    ),
    click.option(
        "--sinks", is_flag=True, help="A random sink logit per query head joins each row's softmax (gpt-oss)."
    ),
)


def local_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The attention of current models as options (`Shape.featured`'s arguments): --window, --chunk,
    --softcap, --sinks."""
    for option in reversed(_LOCAL_OPTIONS):
        command = option(command)
    return command


def suite_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The FlashAttention papers' benchmark suite as options: dtype, lengths, head dims, causal,
    tokens per batch, hidden size and KV heads (`tunegen.measure.suites.prefill_suite`'s arguments).
    The command calls `check_suite` on them."""
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
