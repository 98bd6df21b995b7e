"""The benchmark suites' Shapes count FLOPs at their own sizes, not at their Problems' buckets."""

from __future__ import annotations

from tunegen.measure.suites import Shape, prefill_suite


def test_a_shape_counts_flops_at_its_exact_sizes():
    """21 x 768 tokens (buckets 32 x 1024): 4·B·H·N²·D, halved for causal, as the papers count."""
    shape = Shape(batch=21, heads=16, kv_heads=4, seqlen=768, head_dim=128, causal=False)
    assert shape.flops() == 4.0 * 21 * 16 * 768 * 768 * 128
    causal = Shape(batch=21, heads=16, kv_heads=4, seqlen=768, head_dim=128, causal=True)
    assert causal.flops() == shape.flops() / 2
    problem = shape.problem("bfloat16")
    assert (problem.batch, problem.seqlen_q) == (32, 1024)
    assert problem.flops() > 2.5 * shape.flops()


def test_suite_shapes_at_powers_of_two_match_their_problems():
    for shape in prefill_suite((512, 4096), (64, 128)):
        assert shape.flops() == shape.problem("bfloat16").flops()
