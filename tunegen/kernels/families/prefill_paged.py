"""Chunked prefill over a paged cache: what a prefill Variant needs to read a paged K/V cache
(`Problem.paged`), and the paged inputs of a tuning case.

A serving engine calls it when a new chunk of a prompt attends to what is cached: packed queries
(varlen) over caches of (pages, page_size, kv_heads, head_dim) behind a block table, as
`tunegen.decode_attention` reads them, with each sequence's number of keys (`seqused_k`)."""

from __future__ import annotations

import torch

from tunegen.kernels.problem import Problem
from tunegen.kernels.variant import Variant


def check_paged(variant: Variant, problem: Problem) -> None:
    """A paged Problem's rules (a ValueError naming what does not fit): packed queries, pages of a
    multiple of 16 rows; FlashAttention-2's loop gathers the pages' rows by pointer (load "ptr"),
    and the Hopper schedule loads each key block by TMA, as one box from the page that holds it
    or one box a page where its pages are shorter (blocks divide pages, or pages blocks)."""
    if not problem.varlen:
        raise ValueError("problem.paged: a paged cache serves packed (varlen) queries")
    if problem.page_size <= 0 or problem.page_size % 16:
        raise ValueError(f"problem.page_size: expected a positive multiple of 16, got {problem.page_size}")
    if getattr(variant, "load", "ptr") == "desc":
        raise ValueError("variant.load: a paged cache's rows are gathered by pointer ('ptr'), not 'desc'")
    page, block = problem.page_size, variant.block_n
    if variant.schedule == "ws" and page % block and block % page:
        raise ValueError(
            f"variant.block_n: schedule 'ws' loads a key block from one page or from whole pages; "
            f"{block} keys and pages of {page} rows are neither"
        )


def paged(
    k: torch.Tensor, v: torch.Tensor, page_size: int, gen: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, kv_heads, seqlen, head_dim) keys and values as a paged cache: the caches (pages,
    page_size, kv_heads, head_dim), with pages in an order `gen` shuffles and two spare pages
    that hold NaN (no sequence's), the block table and each sequence's number of keys."""
    batch, heads, n, d = k.shape
    per_seq = -(-n // page_size)
    pages = batch * per_seq + 2
    order = torch.arange(pages, device=k.device)
    if gen is not None:
        order = torch.randperm(pages, generator=gen, device=gen.device).to(k.device)
    table = order[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    caches = []
    for t in (k, v):
        cache = torch.full((pages, page_size, heads, d), float("nan"), dtype=t.dtype, device=t.device)
        rows = torch.zeros(batch, per_seq * page_size, heads, d, dtype=t.dtype, device=t.device)
        rows[:, :n] = t.transpose(1, 2)
        cache[table.flatten().long()] = rows.view(batch * per_seq, page_size, heads, d)
        caches.append(cache)
    seqused = torch.full((batch,), n, dtype=torch.int32, device=k.device)
    return caches[0], caches[1], table, seqused
