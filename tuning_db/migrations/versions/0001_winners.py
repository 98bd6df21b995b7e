"""Winners of the first release: GPUs, Problems, Variants and Winners.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "tunegen_gpus",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("capability", sa.String(16), nullable=False),
        sa.Column("sm_count", sa.Integer, nullable=False),
        sa.Column("smem_per_block", sa.Integer, nullable=False),
        sa.Column("backend", sa.String(32), nullable=False),
        sa.Column("driver", sa.String(64), nullable=False),
        sa.UniqueConstraint("name", "capability", "sm_count", "smem_per_block", "backend"),
    )
    op.create_table(
        "tunegen_problems",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.Text, nullable=False, unique=True),
        sa.Column("family", sa.String(64), nullable=False, index=True),
        sa.Column("features", sa.Text, nullable=False, index=True),
        sa.Column("batch", sa.Integer, nullable=False),
        sa.Column("seqlen_q", sa.Integer, nullable=False),
        sa.Column("seqlen_k", sa.Integer, nullable=False),
    )
    op.create_table(
        "tunegen_variants",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("family", sa.String(64), nullable=False),
        sa.Column("config", sa.Text, nullable=False),
        sa.UniqueConstraint("family", "config"),
    )
    op.create_table(
        "tunegen_winners",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("gpu_id", sa.Integer, sa.ForeignKey("tunegen_gpus.id"), nullable=False),
        sa.Column("problem_id", sa.Integer, sa.ForeignKey("tunegen_problems.id"), nullable=False),
        sa.Column("variant_id", sa.Integer, sa.ForeignKey("tunegen_variants.id"), nullable=False),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("torch_version", sa.String(64), nullable=False),
        sa.Column("cuda_version", sa.String(64), nullable=False),
        sa.Column("template_hash", sa.String(64), nullable=False),
        sa.Column("median_ms", sa.Float, nullable=False),
        sa.Column("tflops", sa.Float, nullable=True),
        sa.Column("gbps", sa.Float, nullable=True),
        sa.Column("rel_err", sa.Float, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("gpu_id", "problem_id", "triton_version"),
    )


def downgrade() -> None:
    for table in ("tunegen_winners", "tunegen_variants", "tunegen_problems", "tunegen_gpus"):
        op.drop_table(table)
